//! End to end: no single message, request or client stops the fleet. Each
//! test sends one poison input that used to stall idem for every device (a
//! NUL in a spec, a packet over the MQTT client's limit, a `seq` of 2^63−1, a
//! spec the broker cannot carry, a database that refuses a row, …) and then
//! checks what matters: **every other device's reports keep being stored,
//! runs keep completing and the server stays ready** — for the queued poison
//! also after a restart.
//!
//! Here: what the tests share (a raw MQTT injector, poison payloads, the
//! check that the fleet is still served). By topic: `mqtt_reports` (poison
//! sent as device messages), `http_requests` (poison sent to the API, and
//! clients that hold connections) and `database_refusals` (a database that
//! refuses a row or blocks the ingest).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_device_sim::{Fleet, FleetPlan, Plan};
use idem_protocol::{Channel, DeviceId};
use idem_tests::{PrivateMosquitto, Scenario, TestServer};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::json;
use tokio::task::JoinHandle;

mod database_refusals;
mod http_requests;
mod mqtt_reports;

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
