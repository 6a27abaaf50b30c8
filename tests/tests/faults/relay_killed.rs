//! Two instances on one broker and one database, events on MQTT with QoS 1;
//! the instance holding the relay lease is SIGKILLed while it publishes a long event log to MQTT and
//! streams it over SSE (converged outcomes stored in slices, then rows). The other takes the relay over from the last saved
//! cursor: no event is missing on MQTT, a repeat carries the same CloudEvent
//! `id` and `sequence`, and the repeats are at most one batch of the relay;
//! an SSE client that followed the killed instance resumes on the other with
//! `Last-Event-ID` and gets every later event once, in order.

use std::time::{Duration, Instant};

use idem_tests::scenario::{append_converged_to, append_events_to};
use idem_tests::SseClient;

use crate::{event_witness, holder_of, private_services, start_servers, SERIAL};

const LEASE: Duration = Duration::from_secs(3);
const EVENTS: usize = 30_000;
/// The relay publishes at most this many events between two saves of its
/// cursor.
const RELAY_BATCH: usize = idem_server::tuning::RELAY_READ_BATCH as usize;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_holder_killed_mid_stream_loses_no_event_and_repeats_at_most_one_batch() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-relay").await;
    let lease = format!("{}ms", LEASE.as_millis());
    // At least once takes QoS 1: a QoS 0 publish still in the killed
    // process's client is gone with it.
    let env = [
        ("IDEM_INSTANCE_LEASE", lease.as_str()),
        ("IDEM_MQTT_EVENTS_QOS", "1"),
    ];
    let mut servers = start_servers(&["a", "b"], (&broker, &db, &tag, &root), &env).await;
    let holder = holder_of(&servers, "relay", Duration::from_secs(15)).await;
    let other = 1 - holder;
    let events = event_witness(&broker, &root).await;
    let first: i64 = sqlx::query_scalar("SELECT coalesce(max(sequence), 0) FROM event_log")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let mut sse = SseClient::connect(
        &servers[holder].url("/v1/events"),
        servers[holder].token(),
        Some(first),
    )
    .await
    .unwrap();
    // Killed while it expands the slices: the other instance carries on
    // inside them.
    let converged_last = append_converged_to(db.pool(), uuid::Uuid::now_v7(), EVENTS / 2)
        .await
        .unwrap();
    let last = append_events_to(db.pool(), EVENTS - EVENTS / 2, 64)
        .await
        .unwrap();

    // Killed once it has published a few batches, with many to go.
    let deadline = Instant::now() + Duration::from_secs(30);
    while events.lock().unwrap().by_id.len() < 3 * RELAY_BATCH {
        assert!(Instant::now() < deadline, "the relay published too little");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    servers[holder].kill().unwrap();
    let at_kill = events.lock().unwrap().by_id.len();
    assert!(
        at_kill < EVENTS / 2,
        "the converged slices were all out before the kill ({at_kill} events): nothing tested"
    );

    // What the killed instance streamed, then the rest from the other.
    let mut seen: Vec<i64> = Vec::new();
    // Until the stream ends with its server (or says anything but an
    // event, which a resume from the last id covers).
    while let Ok(Some(message)) = sse.next_within(Duration::from_secs(5)).await {
        let Some(id) = message.id else { break };
        seen.push(id);
    }
    let resume_from = seen.last().copied().unwrap_or(first);
    let mut sse = SseClient::connect(
        &servers[other].url("/v1/events"),
        servers[other].token(),
        Some(resume_from),
    )
    .await
    .unwrap();
    let rest = sse
        .read_until(
            Duration::from_secs(60),
            &format!("event {last} on the surviving instance"),
            |message| message.id == Some(last),
        )
        .await
        .unwrap();
    seen.extend(
        rest.iter()
            .map(|m| m.id.expect("an SSE event without an id")),
    );
    let expected: Vec<i64> = (first + 1..=last).collect();
    assert!(
        seen == expected,
        "the SSE stream across the kill has a gap or a repeat: {} events, first {:?}, last {:?}",
        seen.len(),
        seen.first(),
        seen.last()
    );

    // Every event on MQTT, once or repeated with its own id.
    let deadline = Instant::now() + LEASE * 3 + Duration::from_secs(30);
    loop {
        let missing = {
            let published = events.lock().unwrap();
            expected
                .iter()
                .filter(|s| !published.by_id.contains_key(s))
                .count()
        };
        if missing == 0 {
            break;
        }
        if Instant::now() >= deadline {
            let gone: Vec<i64> = {
                let published = events.lock().unwrap();
                expected
                    .iter()
                    .copied()
                    .filter(|s| !published.by_id.contains_key(s))
                    .collect()
            };
            panic!(
                "{missing} events never reached MQTT after the relay holder was killed (at \
                 {at_kill} on MQTT): first {:?}, last {:?}, in {} runs",
                gone.first(),
                gone.last(),
                1 + gone.windows(2).filter(|w| w[1] != w[0] + 1).count()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (lost, by_id, ids) = {
        let published = events.lock().unwrap();
        (
            published.lost.clone(),
            published.by_id.clone(),
            published.ids.clone(),
        )
    };
    assert_eq!(lost, None, "the event witness lost its connection");
    let repeats: usize = by_id.values().map(|n| n - 1).sum();
    assert!(
        repeats <= RELAY_BATCH,
        "{repeats} events published twice: more than one batch of the relay"
    );
    for (sequence, ids) in &ids {
        assert_eq!(
            ids.len(),
            1,
            "event {sequence} was repeated with another id: {ids:?}"
        );
        if *sequence > converged_last {
            assert!(
                ids.contains(&sequence.to_string()),
                "event {sequence} carries the id {ids:?}"
            );
        }
    }
    println!(
        "relay holder killed after {at_kill} of {EVENTS} events on MQTT; {repeats} repeated \
         (at most {RELAY_BATCH}), none missing; SSE resumed on the other instance from event \
         {resume_from} with no gap"
    );
}
