//! End to end: no client can stop the HTTP API. Idle connections, the
//! connection cap and each address's share of it, request head and body
//! limits (answered with the API's JSON error), the SSE client cap with its
//! per-token share and admin reserve, SSE clients that stop reading, and the
//! replay rate. Clients that must count as different addresses bind to
//! other loopback addresses (all of 127.0.0.0/8 is local on Linux).
//!
//! Here: what the tests share (polling, raw connections from a chosen
//! address, a raw exchange and its answer). By topic: `connections` (idle
//! connections, the cap, each address's share, shutdown), `request_limits`
//! (request head and body limits), `event_streams` (the SSE caps, slow
//! clients and the replay rate) and `large_reads` (byte-bounded plan pages
//! and the turns of large reads).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

mod connections;
mod event_streams;
mod large_reads;
mod request_limits;

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
