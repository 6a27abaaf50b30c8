//! End to end: no client can stop the HTTP API. Idle connections, the
//! connection cap and each address's share of it, request head and body
//! limits (answered with the API's JSON error), the SSE client cap with its
//! per-token share and admin reserve, SSE clients that stop reading, and the
//! replay rate. Clients that must count as different addresses bind to
//! other loopback addresses (all of 127.0.0.0/8 is local on Linux).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use idem_tests::{
    raise_fd_limit, ApiClient, Scenario, ServerSettings, SseClient, StalledSseClient,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Polls `check` until it yields a value; fails after `timeout`.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET /healthz` on a new connection, `Some(())` when it answers 200 within 1 s.
async fn healthz_once(url: &str) -> Option<()> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(1), client.get(url).send()).await;
    match answer {
        Ok(Ok(response)) if response.status() == 200 => Some(()),
        Ok(Ok(_)) | Ok(Err(_)) | Err(_) => None,
    }
}

/// Reads until the server closes the connection (or resets it).
async fn read_until_closed(mut stream: TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buffer = [0_u8; 4_096];
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return received,
            Ok(n) => received.extend_from_slice(&buffer[..n]),
        }
    }
}

/// A connection to `server` from the loopback address `local`.
async fn connect_from(local: Ipv4Addr, server: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(IpAddr::V4(local), 0)).unwrap();
    socket.connect(server).await.unwrap()
}

/// An HTTP client whose connections come from the loopback address `local`
/// and are not kept for reuse.
fn client_from(local: Ipv4Addr) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(IpAddr::V4(local))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// An answer read off a raw socket: status, headers (names lower-case), body.
#[derive(Debug)]
struct RawAnswer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl RawAnswer {
    /// Parses one HTTP/1.1 answer; `None` when `bytes` holds none.
    fn parse(bytes: &[u8]) -> Option<Self> {
        let text = String::from_utf8_lossy(bytes);
        let (head, body) = text.split_once("\r\n\r\n")?;
        let mut lines = head.split("\r\n");
        let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
        let headers = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
            .collect();
        Some(Self {
            status,
            headers,
            body: body.to_owned(),
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Checks the answer is the API's JSON error with `status` and `code`
    /// and that it closes the connection.
    fn assert_json_error(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{self:?}"
        );
        let body: Value = serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("the body is not JSON ({e}): {self:?}"));
        assert_eq!(body["error"]["code"], code, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert_eq!(self.header("connection"), Some("close"), "{self:?}");
    }
}

/// Sends `request` on a new connection and reads the answer until the
/// server closes it (within 10 s).
async fn raw_exchange(server: SocketAddr, request: &[u8]) -> RawAnswer {
    let mut stream = TcpStream::connect(server).await.unwrap();
    stream.write_all(request).await.unwrap();
    let received = tokio::time::timeout(Duration::from_secs(10), read_until_closed(stream))
        .await
        .expect("the server kept the connection open after refusing the request");
    RawAnswer::parse(&received).unwrap_or_else(|| {
        panic!(
            "no HTTP answer, got {:?}",
            String::from_utf8_lossy(&received)
        )
    })
}

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

async fn assert_body_too_large(response: reqwest::Response, limit: u64) {
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "body_too_large", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("limit is {limit} bytes")),
        "{message}"
    );
    assert!(
        message.contains("--http-max-body-bytes / IDEM_HTTP_MAX_BODY_BYTES"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_over_the_limit_gets_413_naming_the_limit_and_the_flag() {
    let settings = ServerSettings {
        http_max_body_bytes: 4_096,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let devices: Vec<Value> = (0..100)
        .map(|i| json!({"id": format!("big-{i:03}"), "labels": {"note": "n".repeat(40)}}))
        .collect();
    let body = serde_json::to_vec(&devices).unwrap();
    assert!(body.len() > 4_096);
    let url = scenario.server.url("/v1/devices");
    let client = reqwest::Client::new();

    // With a Content-Length: refused before the body is read.
    let answer = client
        .post(&url)
        .bearer_auth(scenario.server.token().unwrap())
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_body_too_large(answer, 4_096).await;

    // Chunked, without a Content-Length: cut off once past the limit.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(1_000).map(|c| Ok(c.to_vec())).collect();
    let answer = client
        .post(&url)
        .bearer_auth(scenario.server.token().unwrap())
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_body_too_large(answer, 4_096).await;

    // A body within the limit is served as usual.
    let (status, answer) = scenario
        .server
        .post("/v1/devices", &json!([{"id": "small-1"}]))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let registered: i64 = sqlx::query_scalar("SELECT count(*) FROM devices")
        .fetch_one(scenario.db.pool())
        .await
        .unwrap();
    assert_eq!(registered, 1, "nothing of the refused bodies is written");
    assert_eq!(
        scenario
            .server
            .metric("idem_http_requests_rejected_total{reason=\"body_too_large\"}")
            .await
            .unwrap(),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_does_not_arrive_in_time_gets_408_and_the_connection_is_closed() {
    let settings = ServerSettings {
        http_body_timeout: Duration::from_millis(500),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let mut stream = TcpStream::connect(scenario.server.addr).await.unwrap();
    // Promise 100 bytes, send two.
    let request = format!(
        "POST /v1/devices HTTP/1.1\r\nhost: idem\r\ncontent-type: application/json\r\n\
         authorization: Bearer {}\r\ncontent-length: 100\r\n\r\n[{{",
        scenario.server.token().unwrap()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), read_until_closed(stream))
        .await
        .expect("the server kept a connection whose body never arrived");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(answer.contains("--http-body-timeout"), "{answer}");
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_long_targets_over_large_heads_and_malformed_requests_get_the_json_error_shape() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let addr = scenario.server.addr;

    // A target over 8 KiB: 414 from the server's own check.
    let long_target = format!(
        "GET /healthz?pad={} HTTP/1.1\r\nhost: idem\r\n\r\n",
        "x".repeat(9_000)
    );
    let answer = raw_exchange(addr, long_target.as_bytes()).await;
    answer.assert_json_error(414, "uri_too_long");
    assert!(answer.body.contains("8192 bytes"), "{answer:?}");

    // Heads hyper refuses itself (its answer has no body; the server
    // writes the JSON error in its place): over 64 KiB, in the target or in
    // one header, and more than 100 header fields.
    let huge_target = format!(
        "GET /v1/fleet?pad={} HTTP/1.1\r\nhost: idem\r\n\r\n",
        "x".repeat(70_000)
    );
    let huge_header = format!(
        "GET /healthz HTTP/1.1\r\nhost: idem\r\nx-pad: {}\r\n\r\n",
        "x".repeat(100_000)
    );
    let many_headers = format!(
        "GET /healthz HTTP/1.1\r\nhost: idem\r\n{}\r\n",
        (0..150)
            .map(|i| format!("x-field-{i}: {i}\r\n"))
            .collect::<String>()
    );
    for request in [&huge_target, &huge_header, &many_headers] {
        let answer = raw_exchange(addr, request.as_bytes()).await;
        answer.assert_json_error(431, "headers_too_large");
        assert!(answer.body.contains("65536 bytes"), "{answer:?}");
    }

    // Not HTTP/1.1 at all: 400.
    let answer = raw_exchange(addr, b"BREW /pot HTCPCP/1.0\r\nhost: idem\r\n\r\n").await;
    answer.assert_json_error(400, "malformed_request");

    let rejected = |reason: &'static str| {
        let server = &scenario.server;
        async move {
            server
                .metric(&format!(
                    "idem_http_requests_rejected_total{{reason=\"{reason}\"}}"
                ))
                .await
                .unwrap()
        }
    };
    assert_eq!(rejected("uri_too_long").await, 1.0);
    assert_eq!(rejected("headers_too_large").await, 3.0);
    assert_eq!(rejected("malformed_request").await, 1.0);
    // A request within the limits on the same server is served as usual.
    let (status, _) = scenario.server.get("/healthz").await.unwrap();
    assert_eq!(status, 200);
}

/// Reads `client` until it delivered `last`; returns every id in order.
async fn read_ids_until(client: &mut SseClient, last: i64) -> Vec<i64> {
    let mut ids = Vec::new();
    loop {
        let message = client
            .next_within(Duration::from_secs(20))
            .await
            .unwrap()
            .expect("the stream ended early");
        let id = message.id.expect("an event without id");
        ids.push(id);
        if id >= last {
            return ids;
        }
    }
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
