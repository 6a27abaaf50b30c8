//! End to end: a graceful stop (the server's token cancelled, which is what
//! SIGTERM does) passes on what was committed before it — the relay relays
//! every committed event and the broker has every one of those publishes
//! before the server returns — and it is bounded: with the broker gone, the
//! server still stops within its flush limits.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idem_protocol::event::RunStartedData;
use idem_protocol::TopicRoot;
use idem_server::app::SHUTDOWN_FLUSH_LIMIT;
use idem_server::events::EventDraft;
use idem_tests::{PrivateMosquitto, Scenario, ServerSettings};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use sqlx::PgPool;
use tokio::sync::mpsc;
use uuid::Uuid;

/// More than one batch of the relay (2,000 events) and more than the MQTT
/// client's in-flight window (1,000 QoS 1 publishes).
const EVENTS: usize = 6_000;

/// Commits `n` `run.started` events in one transaction, as another server
/// instance sharing the database would: nothing wakes this server's relay,
/// which finds them only on its next poll of the log. Returns their
/// subjects (the run ids).
async fn commit_events_of_another_instance(pool: &PgPool, n: usize) -> HashSet<String> {
    let runs: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let drafts = runs
        .iter()
        .map(|run| {
            EventDraft::run_started(
                *run,
                RunStartedData {
                    trigger: idem_protocol::Trigger::Manual,
                    target_count: 0,
                    force: false,
                    started_by: None,
                },
            )
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let first = idem_server::store::events::reserve_sequences(&mut tx, n)
        .await
        .unwrap();
    let rows =
        idem_server::events::finalize(drafts, first, "/idem/another-instance", chrono::Utc::now())
            .unwrap();
    idem_server::store::events::insert(&mut tx, &rows)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    runs.iter().map(Uuid::to_string).collect()
}

/// A subscriber of the server's event topics, collecting the subjects of
/// the `run.started` events it receives.
struct EventSubscriber {
    subjects: mpsc::UnboundedReceiver<String>,
    _client: AsyncClient,
    pump: tokio::task::JoinHandle<()>,
}

impl EventSubscriber {
    /// Subscribes (QoS 1) and waits for the SUBACK, so nothing published
    /// afterwards is missed.
    async fn start(broker: &PrivateMosquitto, root: &TopicRoot) -> Self {
        let id = format!("shutdown-watch-{}", Uuid::new_v4().simple());
        let (client, mut eventloop) = AsyncClient::new(broker.mqtt_options(id), 100);
        client
            .subscribe(root.events_filter(), QoS::AtLeastOnce)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let event = tokio::time::timeout_at(deadline.into(), eventloop.poll())
                .await
                .expect("no SUBACK from the broker within 5 s")
                .unwrap();
            if let Event::Incoming(Packet::SubAck(_)) = event {
                break;
            }
        }
        let prefix = root.event_topic("io.idem.run.started", "");
        let (tx, subjects) = mpsc::unbounded_channel();
        let pump = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if let Event::Incoming(Packet::Publish(p)) = event {
                    if let Some(subject) = p.topic.strip_prefix(&prefix) {
                        let _ = tx.send(subject.to_owned());
                    }
                }
            }
        });
        Self {
            subjects,
            _client: client,
            pump,
        }
    }

    /// Waits until every subject in `expected` has arrived, failing with
    /// how many did not.
    async fn wait_for_all(&mut self, expected: &HashSet<String>, within: Duration) {
        let deadline = Instant::now() + within;
        let mut seen = HashSet::new();
        while !expected.is_subset(&seen) {
            match tokio::time::timeout_at(deadline.into(), self.subjects.recv()).await {
                Ok(Some(subject)) => {
                    seen.insert(subject);
                }
                Ok(None) => panic!("the subscriber's connection ended"),
                Err(_) => panic!(
                    "{} of the {} events committed before the stop never reached a subscriber \
                     within {within:?} of it",
                    expected.difference(&seen).count(),
                    expected.len()
                ),
            }
        }
        self.pump.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_relays_every_committed_event_and_the_broker_has_each_before_it_returns() {
    let settings = ServerSettings {
        mqtt_events_qos: 1,
        ..ServerSettings::default()
    };
    let Scenario { server, db, broker } = Scenario::start(settings).await.unwrap();
    let mut subscriber = EventSubscriber::start(&broker, &server.topic_root).await;
    let committed = commit_events_of_another_instance(db.pool(), EVENTS).await;

    let stopping = Instant::now();
    server.stop().await.unwrap();
    let took = stopping.elapsed();
    eprintln!("a graceful stop with {EVENTS} events of another instance to relay took {took:?}");

    let relayed: Option<i64> =
        sqlx::query_scalar("SELECT sequence FROM event_cursors WHERE name = 'relay'")
            .fetch_optional(db.pool())
            .await
            .unwrap();
    let last: i64 = sqlx::query_scalar("SELECT last FROM event_sequence")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(
        relayed,
        Some(last),
        "the relay's cursor once the server stopped, against the last committed event"
    );
    // The server wrote them all before its DISCONNECT, and the broker read
    // that before it closed the connection: they reach the subscriber.
    subscriber
        .wait_for_all(&committed, Duration::from_secs(20))
        .await;
    assert!(
        took < SHUTDOWN_FLUSH_LIMIT,
        "the stop took {took:?}: a step was cut short by its limit ({SHUTDOWN_FLUSH_LIMIT:?}) \
         instead of ending when its work was done"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_broker_is_gone_still_stops_within_its_flush_limits() {
    let Scenario {
        server,
        db: _db,
        mut broker,
    } = Scenario::start(ServerSettings::default()).await.unwrap();
    tokio::task::block_in_place(|| broker.stop()).unwrap();

    // The relay's and the MQTT connection's limits, and the rest's moment.
    let bound = SHUTDOWN_FLUSH_LIMIT * 2 + Duration::from_secs(2);
    tokio::time::timeout(bound, server.stop())
        .await
        .unwrap_or_else(|_| {
            panic!("the server had not stopped {bound:?} after its token was cancelled, its broker gone")
        })
        .unwrap();
}
