//! The limits on event streams (`GET /v1/events`): the stream cap, each
//! token's share and the admin reserve, a client that stops reading, and
//! the replay rate.

use std::time::{Duration, Instant};

use idem_tests::{Scenario, ServerSettings, SseClient, StalledSseClient};
use serde_json::Value;

use crate::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_clients_beyond_the_cap_get_503_naming_the_limit_and_a_freed_slot_is_reused() {
    let settings = ServerSettings {
        sse_max_clients: 2,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let url = scenario.server.url("/v1/events");
    // One stream per token: the share of each token is 1 of 2.
    let admin = |name: &'static str| {
        let server = &scenario.server;
        async move { server.client_for_role(name, "admin").await.unwrap() }
    };
    let (second_admin, third_admin) = (admin("admin-2").await, admin("admin-3").await);
    // A query the handler cannot read is the API's JSON error too.
    let bad = SseClient::open(&format!("{url}?after=soon"), scenario.server.token(), None)
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let body: Value = bad.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_query", "{body}");
    let first = SseClient::connect(&url, scenario.server.token(), None)
        .await
        .unwrap();
    let _second = SseClient::connect(&url, second_admin.token(), None)
        .await
        .unwrap();

    let refused = SseClient::open(&url, third_admin.token(), None)
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "5");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_sse_clients", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("limit is 2"), "{message}");
    assert!(
        message.contains("--sse-max-clients / IDEM_SSE_MAX_CLIENTS"),
        "{message}"
    );
    assert_eq!(
        scenario.server.metric("idem_sse_clients").await.unwrap(),
        2.0
    );
    assert_eq!(
        scenario
            .server
            .metric("idem_sse_clients_refused_total{reason=\"max_clients\"}")
            .await
            .unwrap(),
        1.0
    );

    drop(first);
    let server = &scenario.server;
    wait_for(
        "the closed stream's slot being released",
        Duration::from_secs(20),
        || async move { (server.metric("idem_sse_clients").await.ok() == Some(1.0)).then_some(()) },
    )
    .await;
    SseClient::connect(&url, scenario.server.token(), None)
        .await
        .unwrap();
}

/// Checks `response` is the JSON refusal `status` / `code` with a `Retry-After`.
async fn assert_stream_refused(response: reqwest::Response, status: u16, code: &str) {
    assert_eq!(
        response.status(),
        status,
        "the event stream was not refused with {status} {code}"
    );
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(retry_after.as_deref(), Some("5"), "Retry-After");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_token_gets_no_more_event_streams_than_its_share_and_an_admin_still_opens_one() {
    // 8 streams: 2 per token (a quarter), 2 kept for admins.
    let settings = ServerSettings {
        sse_max_clients: 8,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let url = scenario.server.url("/v1/events");
    let viewer = scenario
        .server
        .client_for_role("dashboard", "viewer")
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..2 {
        streams.push(
            SseClient::connect(&url, viewer.token(), None)
                .await
                .unwrap(),
        );
    }
    for _ in 0..3 {
        let extra = SseClient::open(&url, viewer.token(), None).await.unwrap();
        assert_stream_refused(extra, 429, "too_many_sse_clients_for_token").await;
    }
    SseClient::connect(&url, scenario.server.token(), None)
        .await
        .expect("an admin could not open an event stream while a viewer token held its share");
    assert_eq!(
        scenario
            .server
            .metric("idem_sse_clients_refused_total{reason=\"per_token\"}")
            .await
            .unwrap(),
        3.0
    );
    drop(streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn viewers_and_operators_together_never_take_the_event_streams_kept_for_admins() {
    let settings = ServerSettings {
        sse_max_clients: 8,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let url = scenario.server.url("/v1/events");
    let mut callers = Vec::new();
    for (name, role) in [
        ("viewer-1", "viewer"),
        ("viewer-2", "viewer"),
        ("operator-1", "operator"),
        ("viewer-3", "viewer"),
    ] {
        callers.push(scenario.server.client_for_role(name, role).await.unwrap());
    }
    // Three tokens at their share fill the 6 slots that are not reserved.
    let mut streams = Vec::new();
    for caller in &callers[..3] {
        for _ in 0..2 {
            streams.push(
                SseClient::connect(&url, caller.token(), None)
                    .await
                    .unwrap(),
            );
        }
    }
    for _ in 0..2 {
        let refused = SseClient::open(&url, callers[3].token(), None)
            .await
            .unwrap();
        assert_stream_refused(refused, 503, "sse_clients_reserved_for_admins").await;
    }
    // The reserve is there for admins: two of them open a stream each.
    let second_admin = scenario
        .server
        .client_for_role("admin-2", "admin")
        .await
        .unwrap();
    for token in [scenario.server.token(), second_admin.token()] {
        streams.push(
            SseClient::connect(&url, token, None)
                .await
                .expect("an admin could not open an event stream kept for admins"),
        );
    }
    assert_eq!(
        scenario
            .server
            .metric("idem_sse_clients_refused_total{reason=\"admin_reserve\"}")
            .await
            .unwrap(),
        2.0
    );
    assert_eq!(
        scenario.server.metric("idem_sse_clients").await.unwrap(),
        8.0
    );
}

/// Reads `client` until it delivered `last` (within 60 s); returns every
/// id in order.
async fn read_ids_until(client: &mut SseClient, last: i64) -> Vec<i64> {
    client
        .read_until(
            Duration::from_secs(60),
            &format!("event {last}"),
            |message| message.id.is_some_and(|id| id >= last),
        )
        .await
        .unwrap()
        .iter()
        .map(|message| message.id.expect("an event without id"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_client_that_stops_reading_is_dropped_while_others_keep_receiving_and_resumes_without_gap(
) {
    let settings = ServerSettings {
        sse_client_buffer: 16,
        sse_send_timeout: Duration::from_millis(500),
        sse_replay_rate: 1_000_000,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    // About 9 MB of events: twice what the server's socket send buffer (at
    // most 4 MiB with Linux defaults), hyper's buffer and the queue hold.
    let last = scenario.append_events(8_000, 1_000).await.unwrap();
    let url = scenario.server.url("/v1/events?after=0");

    let mut reader = SseClient::connect(&url, scenario.server.token(), None)
        .await
        .unwrap();
    let stalled = StalledSseClient::open(
        scenario.server.addr,
        "/v1/events?after=0",
        scenario.server.token(),
    )
    .await
    .unwrap();
    let reading = tokio::spawn(async move {
        let ids = read_ids_until(&mut reader, last).await;
        (reader, ids)
    });

    let server = &scenario.server;
    wait_for(
        "the stalled client being dropped",
        Duration::from_secs(30),
        || async move {
            let dropped = server
                .metric("idem_sse_clients_dropped_total{reason=\"send_timeout\"}")
                .await
                .ok()?;
            (dropped >= 1.0).then_some(())
        },
    )
    .await;

    // The reading client got the whole log, and gets what comes next.
    let (mut reader, ids) = reading.await.unwrap();
    assert_eq!(ids, (1..=last).collect::<Vec<_>>());
    let newest = scenario.append_events(10, 10).await.unwrap();
    assert_eq!(
        read_ids_until(&mut reader, newest).await,
        (last + 1..=newest).collect::<Vec<_>>()
    );
    assert_eq!(
        scenario
            .server
            .metric("idem_sse_clients_dropped_total{reason=\"send_timeout\"}")
            .await
            .unwrap(),
        1.0,
        "only the stalled client is dropped"
    );

    // The stalled client now reads what reached it: a prefix of the log,
    // perhaps followed by the `dropped` event naming where to resume.
    let messages = stalled.read_to_end(Duration::from_secs(30)).await.unwrap();
    let received: Vec<i64> = messages.iter().filter_map(|m| m.id).collect();
    assert!(
        (received.len() as i64) < last,
        "the stalled client was sent everything"
    );
    assert_eq!(received, (1..=received.len() as i64).collect::<Vec<_>>());
    let resume_after = received.last().copied().unwrap_or(0);
    let dropped_seen = messages
        .iter()
        .any(|m| m.event.as_deref() == Some("dropped"));
    println!(
        "the stalled client had received {} of {last} events (final `dropped` event: {dropped_seen})",
        received.len()
    );
    if let Some(dropped) = messages
        .iter()
        .find(|m| m.event.as_deref() == Some("dropped"))
    {
        let body: Value = serde_json::from_str(&dropped.data).unwrap();
        assert_eq!(body["reason"], "send_timeout", "{body}");
        assert_eq!(body["resume_after"], resume_after, "{body}");
    }

    // Resuming from its last event misses nothing and repeats nothing.
    let mut resumed = SseClient::connect(
        &scenario.server.url("/v1/events"),
        scenario.server.token(),
        Some(resume_after),
    )
    .await
    .unwrap();
    assert_eq!(
        read_ids_until(&mut resumed, newest).await,
        (resume_after + 1..=newest).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_from_the_log_is_sent_at_no_more_than_the_configured_rate() {
    let settings = ServerSettings {
        sse_replay_rate: 200,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let last = scenario.append_events(600, 10).await.unwrap();
    let mut client = SseClient::connect(
        &scenario.server.url("/v1/events?after=0"),
        scenario.server.token(),
        None,
    )
    .await
    .unwrap();
    let first = client
        .next_within(Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.id, Some(1));
    let started = Instant::now();
    let rest = read_ids_until(&mut client, last).await;
    let elapsed = started.elapsed();
    assert_eq!(rest, (2..=last).collect::<Vec<_>>());
    let rate = rest.len() as f64 / elapsed.as_secs_f64();
    println!(
        "replayed {} events in {elapsed:?}: {rate:.0} events/s at --sse-replay-rate 200",
        rest.len()
    );
    assert!(rate <= 300.0, "replayed at {rate:.0} events/s");
}
