//! Clients for the server's event stream (`GET /v1/events`): a streaming
//! SSE reader over reqwest, and a raw TCP reader with a tiny receive buffer
//! that can stop reading, to play a client that does not keep up.
//!
//! They only speak HTTP to a server; they own no server and parse nothing
//! but the SSE framing.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::deadline::{within, Deadline};

/// One parsed SSE message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseMessage {
    pub id: Option<i64>,
    pub event: Option<String>,
    pub data: String,
}

impl SseMessage {
    /// The CloudEvent `type` in the data, when the data is an event.
    fn event_type(&self) -> Option<String> {
        let value: serde_json::Value = serde_json::from_str(&self.data).ok()?;
        value["type"].as_str().map(str::to_owned)
    }

    /// `id 7 (io.idem.run.started)`, for error messages.
    fn describe(&self) -> String {
        let id = self
            .id
            .map_or_else(|| "without id".to_owned(), |id| format!("id {id}"));
        match self.event_type().or_else(|| self.event.clone()) {
            Some(kind) => format!("{id} ({kind})"),
            None => id,
        }
    }
}

/// What one read of the buffer took off it.
#[derive(Debug, Default)]
struct Taken {
    messages: Vec<SseMessage>,
    /// Comments (`: keep-alive`) and other blocks without data.
    empty_blocks: usize,
}

/// Takes every complete message (blocks ending in a blank line) off the
/// front of `buffer`; keep-alive comments and blocks without data are skipped.
pub fn take_messages(buffer: &mut String) -> Result<Vec<SseMessage>> {
    Ok(take_blocks(buffer)?.messages)
}

fn take_blocks(buffer: &mut String) -> Result<Taken> {
    let mut taken = Taken::default();
    while let Some(end) = buffer.find("\n\n") {
        let block: String = buffer.drain(..end + 2).collect();
        let mut message = SseMessage {
            id: None,
            event: None,
            data: String::new(),
        };
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                message.id = Some(
                    v.trim()
                        .parse()
                        .with_context(|| format!("SSE id {v:?} is not a number"))?,
                );
            } else if let Some(v) = line.strip_prefix("event:") {
                message.event = Some(v.trim().to_owned());
            } else if let Some(v) = line.strip_prefix("data:") {
                message.data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if message.data.is_empty() {
            taken.empty_blocks += 1;
        } else {
            taken.messages.push(message);
        }
    }
    Ok(taken)
}

/// How long connecting to the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the server may take to answer the request with a response head.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// How many of the messages skipped by [`SseClient::read_until`] an error
/// names (the last ones).
const NAMED_IN_ERRORS: usize = 5;

/// A streaming SSE reader. Every read has a deadline, and only a message
/// counts as progress: keep-alive comments never extend a wait.
pub struct SseClient {
    /// What this client follows (URL and `Last-Event-ID`), for errors.
    source: String,
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: String,
    ready: VecDeque<SseMessage>,
    /// What arrived since the last message was handed out, for errors.
    comments_since_message: usize,
    bytes_since_message: usize,
    /// The last message handed out.
    last: Option<SseMessage>,
}

impl SseClient {
    /// Opens `url` (optionally with `Last-Event-ID`) and returns the raw
    /// response, whatever its status; fails when the server does not
    /// answer with a response head within 30 s.
    pub async fn open(
        url: &str,
        token: Option<&str>,
        last_event_id: Option<i64>,
    ) -> Result<reqwest::Response> {
        // No overall request timeout: it would end a healthy stream. The
        // connection and the response head are bounded; reads are bounded
        // by each caller's deadline.
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .context("building the SSE client")?;
        let mut request = client.get(url).header("accept", "text/event-stream");
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id.to_string());
        }
        within(
            RESPONSE_TIMEOUT,
            format!("the response head of GET {url}"),
            request.send(),
        )
        .await?
        .with_context(|| format!("GET {url}"))
    }

    /// Opens `url` (sending `token` when given) and fails unless the server
    /// answers 200.
    pub async fn connect(
        url: &str,
        token: Option<&str>,
        last_event_id: Option<i64>,
    ) -> Result<Self> {
        let response = Self::open(url, token, last_event_id).await?;
        let status = response.status();
        if status != 200 {
            let body = within(RESPONSE_TIMEOUT, "the refusal's body", response.text())
                .await?
                .unwrap_or_default();
            bail!("GET {url} answered {status}: {body}");
        }
        let source = match last_event_id {
            Some(id) => format!("{url} (Last-Event-ID {id})"),
            None => url.to_owned(),
        };
        Ok(Self {
            source,
            stream: response.bytes_stream().boxed(),
            buffer: String::new(),
            ready: VecDeque::new(),
            comments_since_message: 0,
            bytes_since_message: 0,
            last: None,
        })
    }

    /// The next message with data, `None` when the stream ended; fails when
    /// no message arrives within `limit` (keep-alive comments do not count).
    pub async fn next_within(&mut self, limit: Duration) -> Result<Option<SseMessage>> {
        self.next_before(&Deadline::after(limit)).await
    }

    /// The next message with data before `deadline`, `None` when the stream
    /// ended. The error names the stream and what arrived meanwhile.
    pub async fn next_before(&mut self, deadline: &Deadline) -> Result<Option<SseMessage>> {
        loop {
            if let Some(message) = self.ready.pop_front() {
                self.comments_since_message = 0;
                self.bytes_since_message = 0;
                self.last = Some(message.clone());
                return Ok(Some(message));
            }
            let chunk = match deadline.run("", self.stream.next()).await {
                Ok(chunk) => chunk,
                Err(_) => bail!(
                    "no SSE message on {} within {:?}; meanwhile {}",
                    self.source,
                    deadline.limit(),
                    self.arrived_meanwhile()
                ),
            };
            match chunk {
                None => return Ok(None),
                Some(chunk) => {
                    let chunk =
                        chunk.with_context(|| format!("reading the SSE stream {}", self.source))?;
                    self.bytes_since_message += chunk.len();
                    self.buffer.push_str(&String::from_utf8_lossy(&chunk));
                    let taken = take_blocks(&mut self.buffer)?;
                    self.comments_since_message += taken.empty_blocks;
                    self.ready.extend(taken.messages);
                }
            }
        }
    }

    /// Every message up to and including the first for which `is_last`
    /// holds, all within `limit`. Fails naming `what`, the stream and the
    /// messages that arrived meanwhile when the deadline passes or the
    /// stream ends first.
    pub async fn read_until(
        &mut self,
        limit: Duration,
        what: &str,
        mut is_last: impl FnMut(&SseMessage) -> bool,
    ) -> Result<Vec<SseMessage>> {
        let deadline = Deadline::after(limit);
        let mut read = Vec::new();
        loop {
            let next = match self.next_before(&deadline).await {
                Ok(next) => next,
                Err(e) => {
                    return Err(e.context(format!(
                        "waiting for {what}: {} other messages arrived before the deadline{}",
                        read.len(),
                        last_of(&read)
                    )))
                }
            };
            let Some(message) = next else {
                bail!(
                    "the SSE stream {} ended before {what}: {} other messages arrived{}",
                    self.source,
                    read.len(),
                    last_of(&read)
                );
            };
            let done = is_last(&message);
            read.push(message);
            if done {
                return Ok(read);
            }
        }
    }

    /// `3 keep-alive comments and 42 bytes arrived, no complete message
    /// (the last message before them: id 7 (io.idem.run.started))`.
    fn arrived_meanwhile(&self) -> String {
        let last = match &self.last {
            Some(message) => format!("the last message before them: {}", message.describe()),
            None => "no message was received on this stream yet".to_owned(),
        };
        format!(
            "{} keep-alive comments and {} bytes arrived, no complete message ({last})",
            self.comments_since_message, self.bytes_since_message
        )
    }
}

/// `; the last of them: id 4 (…), id 5 (…)` for the last few of `read`.
fn last_of(read: &[SseMessage]) -> String {
    if read.is_empty() {
        return String::new();
    }
    let from = read.len().saturating_sub(NAMED_IN_ERRORS);
    let named: Vec<String> = read[from..].iter().map(SseMessage::describe).collect();
    format!("; the last of them: {}", named.join(", "))
}

/// An SSE request on a raw socket with a small receive buffer, which reads
/// nothing until told to: the server's send path fills up quickly.
pub struct StalledSseClient {
    stream: TcpStream,
}

impl StalledSseClient {
    /// Sends `GET {path}` to `addr` and reads nothing.
    pub async fn open(addr: SocketAddr, path: &str, token: Option<&str>) -> Result<Self> {
        let socket = TcpSocket::new_v4().context("creating a socket")?;
        // Before connecting, so the advertised window stays small.
        socket
            .set_recv_buffer_size(4_096)
            .context("setting SO_RCVBUF")?;
        let mut stream = within(
            CONNECT_TIMEOUT,
            format!("connecting to {addr}"),
            socket.connect(addr),
        )
        .await?
        .with_context(|| format!("connecting to {addr}"))?;
        let authorization = token
            .map(|t| format!("authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "GET {path} HTTP/1.1\r\nhost: {addr}\r\naccept: text/event-stream\r\n{authorization}\r\n"
        );
        within(
            RESPONSE_TIMEOUT,
            format!("sending GET {path} to {addr}"),
            stream.write_all(request.as_bytes()),
        )
        .await?
        .context("sending the request")?;
        Ok(Self { stream })
    }

    /// Reads what the server sent until it ended the response or closed the
    /// connection, and returns the SSE messages in it.
    pub async fn read_to_end(mut self, timeout: Duration) -> Result<Vec<SseMessage>> {
        let mut raw = Vec::new();
        let mut chunk = vec![0_u8; 64 * 1024];
        let read_all = async {
            loop {
                match self.stream.read(&mut chunk).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => {
                        raw.extend_from_slice(&chunk[..n]);
                        if raw.ends_with(b"\r\n0\r\n\r\n") {
                            return Ok(());
                        }
                    }
                    // A reset after the server gave up on us ends the data too.
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
        };
        tokio::time::timeout(timeout, read_all)
            .await
            .with_context(|| format!("the server neither ended the stream nor closed the connection within {timeout:?}"))?
            .context("reading the stalled stream")?;
        let head_end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .context("no complete response head")?;
        let head = String::from_utf8_lossy(&raw[..head_end]).into_owned();
        if !head.starts_with("HTTP/1.1 200") {
            bail!("the stalled request was answered {head}");
        }
        let mut text = String::from_utf8_lossy(&dechunk(&raw[head_end + 4..])).into_owned();
        take_messages(&mut text)
    }
}

/// The data of a chunked body, as far as it was received.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    loop {
        let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") else {
            return data;
        };
        let size = std::str::from_utf8(&body[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
        let Some(size) = size else {
            return data;
        };
        if size == 0 {
            return data;
        }
        body = &body[line_end + 2..];
        let take = size.min(body.len());
        data.extend_from_slice(&body[..take]);
        if take < size || body.len() < size + 2 {
            return data;
        }
        body = &body[size + 2..];
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_chunked_body_cut_off_mid_chunk_keeps_what_arrived() {
        assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), b"abcde");
        assert_eq!(dechunk(b"3\r\nabc\r\n5\r\nde"), b"abcde");
    }

    /// Serves one SSE response on 127.0.0.1 that sends `first` (if any),
    /// then only a keep-alive comment every 100 ms, as the server does when
    /// nothing happens; returns the stream's URL.
    async fn keep_alive_only_server(first: Option<&'static str>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = vec![0_u8; 4096];
            let _ = socket.read(&mut head).await.unwrap();
            let chunk = |data: &str| format!("{:x}\r\n{data}\r\n", data.len());
            let mut out = String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                 transfer-encoding: chunked\r\n\r\n",
            );
            if let Some(first) = first {
                out.push_str(&chunk(first));
            }
            loop {
                out.push_str(&chunk(": keep-alive\n\n"));
                if socket.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
                out.clear();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        format!("http://{addr}/v1/events")
    }

    #[tokio::test]
    async fn a_wait_for_a_message_ends_at_its_deadline_though_keep_alives_keep_coming() {
        let url = keep_alive_only_server(None).await;
        let mut client = SseClient::connect(&url, None, None).await.unwrap();
        let started = std::time::Instant::now();
        // A per-chunk timeout would never fire here: the bound around the
        // call is what reports that failure instead of hanging.
        let answer = tokio::time::timeout(
            Duration::from_secs(3),
            client.next_within(Duration::from_millis(500)),
        )
        .await
        .expect("next_within(500 ms) was still waiting after 3 s of keep-alive comments");
        let error = format!("{:#}", answer.unwrap_err());
        assert!(started.elapsed() >= Duration::from_millis(500), "{error}");
        assert!(error.contains(&url), "the error names the stream: {error}");
        assert!(
            error.contains("within 500ms") && error.contains("keep-alive comments"),
            "the error says what arrived meanwhile: {error}"
        );
        assert!(
            error.contains("no message was received on this stream yet"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn reading_until_a_message_names_what_was_awaited_and_what_came_instead() {
        let url =
            keep_alive_only_server(Some("id: 7\ndata: {\"type\":\"io.idem.run.started\"}\n\n"))
                .await;
        let mut client = SseClient::connect(&url, None, Some(6)).await.unwrap();
        let answer = tokio::time::timeout(
            Duration::from_secs(3),
            client.read_until(Duration::from_millis(500), "the run's run.completed", |m| {
                m.data.contains("run.completed")
            }),
        )
        .await
        .expect("read_until(500 ms) was still waiting after 3 s");
        let error = format!("{:#}", answer.unwrap_err());
        assert!(
            error.contains("waiting for the run's run.completed: 1 other messages arrived")
                && error.contains("id 7 (io.idem.run.started)")
                && error.contains("(Last-Event-ID 6)"),
            "{error}"
        );
    }

    #[test]
    fn messages_are_taken_only_when_complete() {
        let mut buffer =
            String::from(": keep-alive\n\nid: 4\ndata: {}\n\nevent: dropped\ndata: {\"a\"");
        let messages = take_messages(&mut buffer).unwrap();
        assert_eq!(
            messages,
            vec![SseMessage {
                id: Some(4),
                event: None,
                data: "{}".into()
            }]
        );
        assert_eq!(buffer, "event: dropped\ndata: {\"a\"");
    }
}
