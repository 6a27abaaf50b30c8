//! Request limits answered with the API's JSON error: a body over the size
//! limit or late for its deadline, an over-long target, an over-large head
//! and a malformed request.

use std::time::Duration;

use idem_tests::{Scenario, ServerSettings};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::{raw_exchange, read_until_closed};

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
