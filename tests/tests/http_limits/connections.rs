//! Connections no client can use to take the API down: a thousand idle
//! ones, those beyond the cap or beyond an address's share (answered in
//! JSON and closed at once), idle keep-alive connections, and what is open
//! when the server stops.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use idem_tests::{raise_fd_limit, ApiClient, Scenario, ServerSettings, SseClient};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::{client_from, connect_from, healthz_once, read_until_closed, wait_for, RawAnswer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_within_a_second_while_a_thousand_idle_connections_are_open() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let limit = raise_fd_limit().unwrap();
    assert!(
        limit > 2_500,
        "the open-file limit {limit} is too low for this test"
    );
    let mut idle = Vec::with_capacity(1_000);
    for _ in 0..1_000 {
        idle.push(TcpStream::connect(scenario.server.addr).await.unwrap());
    }
    let url = scenario.server.url("/healthz");
    let client = reqwest::Client::new();
    let answer = tokio::time::timeout(Duration::from_secs(1), client.get(&url).send())
        .await
        .expect("GET /healthz did not answer within 1 s with 1,000 idle connections open")
        .unwrap();
    assert_eq!(answer.status(), 200);
    // The idle connections were accepted and are held open, not refused.
    let open = scenario
        .server
        .metric("idem_http_connections")
        .await
        .unwrap();
    assert!(open >= 1_000.0, "idem_http_connections = {open}");
    for reason in ["max_connections", "max_connections_per_peer"] {
        let series = format!("idem_http_connections_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(
            scenario.server.metric(&series).await.unwrap(),
            0.0,
            "{series}"
        );
    }
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_answered_503_and_closed_at_once_and_healthz_answers_again_once_idle_ones_time_out(
) {
    let settings = ServerSettings {
        http_max_connections: 50,
        sse_max_clients: 10,
        http_header_timeout: Duration::from_secs(1),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let addr = scenario.server.addr;
    // 200 connections from 20 addresses, 10 each: within every address's
    // share (13 of 50), so only the global cap refuses them.
    let mut idle = Vec::with_capacity(200);
    for i in 0..200_u8 {
        idle.push(connect_from(Ipv4Addr::new(127, 0, 0, 10 + i % 20), addr).await);
    }
    // Every one of them is closed by the server: those over the cap at once,
    // the others when they have sent no request head for a second.
    let closed =
        futures::future::join_all(idle.into_iter().map(|stream| {
            tokio::time::timeout(Duration::from_secs(10), read_until_closed(stream))
        }))
        .await;
    let still_open = closed.iter().filter(|r| r.is_err()).count();
    assert_eq!(still_open, 0, "connections the server never closed");
    // Those refused at the cap were told so in JSON; the others got nothing.
    let mut answered = 0;
    for received in closed.iter().flatten().filter(|r| !r.is_empty()) {
        let answer = RawAnswer::parse(received).expect("an HTTP answer");
        answer.assert_json_error(503, "too_many_connections");
        assert_eq!(answer.header("retry-after"), Some("1"), "{answer:?}");
        answered += 1;
    }

    let url = scenario.server.url("/healthz");
    wait_for(
        "GET /healthz answering 200 after the idle connections timed out",
        Duration::from_secs(10),
        || healthz_once(&url),
    )
    .await;
    let refused = scenario
        .server
        .metric("idem_http_connections_refused_total{reason=\"max_connections\"}")
        .await
        .unwrap();
    // 200 opened, at most 50 held (a few slots were taken by the harness's
    // own pooled connections).
    assert!(
        (150.0..=160.0).contains(&refused),
        "refused at the cap: {refused}"
    );
    assert_eq!(f64::from(answered), refused, "every refusal is answered");
    let open = scenario
        .server
        .metric("idem_http_connections")
        .await
        .unwrap();
    assert!(open <= 50.0, "idem_http_connections = {open}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holding_more_connections_than_its_share_is_refused_in_json_and_other_addresses_are_answered_within_a_second(
) {
    // A share of 10 (a quarter of 40) per address.
    let settings = ServerSettings {
        http_max_connections: 40,
        sse_max_clients: 10,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let addr = scenario.server.addr;
    let greedy = Ipv4Addr::new(127, 0, 0, 3);
    let other = Ipv4Addr::new(127, 0, 0, 2);
    let mut held = Vec::with_capacity(100);
    for _ in 0..100 {
        held.push(connect_from(greedy, addr).await);
    }

    // Another address is answered at once, liveness and the API alike.
    let started = Instant::now();
    let healthz = tokio::time::timeout(
        Duration::from_secs(1),
        client_from(other)
            .get(scenario.server.url("/healthz"))
            .send(),
    )
    .await
    .expect("GET /healthz from another address did not answer within 1 s")
    .unwrap_or_else(|e| panic!("GET /healthz from another address failed: {e:?}"));
    assert_eq!(
        healthz.status(),
        200,
        "GET /healthz from another address: {:?}",
        healthz.text().await
    );
    let api = ApiClient::with_client(addr, client_from(other)).with_token(scenario.server.token());
    let (status, fleet) = tokio::time::timeout(Duration::from_secs(1), api.get("/v1/fleet"))
        .await
        .expect("GET /v1/fleet from another address did not answer within 1 s")
        .unwrap_or_else(|e| panic!("GET /v1/fleet from another address failed: {e:?}"));
    assert_eq!(status, 200, "GET /v1/fleet from another address: {fleet}");
    println!(
        "another address was answered within {:?} while one held 100 connections",
        started.elapsed()
    );

    // The greedy address holds its share; the rest were refused in JSON.
    let read =
        futures::future::join_all(held.into_iter().map(|stream| {
            tokio::time::timeout(Duration::from_millis(500), read_until_closed(stream))
        }))
        .await;
    let still_held = read.iter().filter(|r| r.is_err()).count();
    assert_eq!(still_held, 10, "connections the greedy address holds");
    for received in read.iter().flatten() {
        let answer = RawAnswer::parse(received).unwrap_or_else(|| {
            panic!(
                "a connection over the share was closed without an answer: {:?}",
                String::from_utf8_lossy(received)
            )
        });
        answer.assert_json_error(429, "too_many_connections_from_peer");
        assert_eq!(answer.header("retry-after"), Some("10"), "{answer:?}");
        assert!(
            answer.body.contains("--http-max-connections-per-peer"),
            "{answer:?}"
        );
    }
    let server = &scenario.server;
    let metric = |reason: &'static str| async move {
        let series = format!("idem_http_connections_refused_total{{reason=\"{reason}\"}}");
        server.metric(&series).await.unwrap()
    };
    assert_eq!(metric("max_connections_per_peer").await, 90.0);
    assert_eq!(metric("max_connections").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_server_ends_open_sse_streams_and_closes_idle_connections_promptly() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let mut stream = SseClient::connect(
        &scenario.server.url("/v1/events"),
        scenario.server.token(),
        None,
    )
    .await
    .unwrap();
    let idle = TcpStream::connect(scenario.server.addr).await.unwrap();
    let server = &scenario.server;
    wait_for(
        "the stream and the idle connection being accepted",
        Duration::from_secs(10),
        || async move {
            let open = server.metric("idem_http_connections").await.ok()?;
            (open >= 3.0).then_some(())
        },
    )
    .await;

    let Scenario { server, db, broker } = scenario;
    let started = Instant::now();
    server.stop().await.unwrap();
    let took = started.elapsed();
    // Well below the 5 s grace that in-flight requests could have used.
    assert!(took < Duration::from_secs(3), "stopping took {took:?}");
    assert_eq!(
        stream.next_within(Duration::from_secs(5)).await.unwrap(),
        None,
        "the SSE stream ends"
    );
    tokio::time::timeout(Duration::from_secs(5), read_until_closed(idle))
        .await
        .expect("the idle connection is closed");
    drop((db, broker));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_header_timeout() {
    let settings = ServerSettings {
        http_header_timeout: Duration::from_secs(1),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let mut stream = TcpStream::connect(scenario.server.addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: idem\r\n\r\n")
        .await
        .unwrap();
    // The answer arrives and the connection stays open for the next request
    // until the header timeout closes it.
    let opened = Instant::now();
    let received = tokio::time::timeout(Duration::from_secs(10), read_until_closed(stream))
        .await
        .expect("the idle keep-alive connection was never closed");
    let received = String::from_utf8_lossy(&received);
    assert!(received.starts_with("HTTP/1.1 200"), "{received}");
    assert!(received.contains("\"ok\""), "{received}");
    let idle_for = opened.elapsed();
    assert!(
        idle_for >= Duration::from_millis(900),
        "closed after {idle_for:?}, before the header timeout"
    );
}
