//! Clients for the server's event stream (`GET /v1/events`): a streaming
//! SSE reader over reqwest, and a raw TCP reader with a tiny receive buffer
//! that can stop reading, to play a client that does not keep up.
//!
//! They only speak HTTP to a server; they own no server and parse nothing
//! but the SSE framing.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// One parsed SSE message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseMessage {
    pub id: Option<i64>,
    pub event: Option<String>,
    pub data: String,
}

/// Takes every complete message (blocks ending in a blank line) off the
/// front of `buffer`; keep-alive comments and blocks without data are skipped.
pub fn take_messages(buffer: &mut String) -> Result<Vec<SseMessage>> {
    let mut messages = Vec::new();
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
        if !message.data.is_empty() {
            messages.push(message);
        }
    }
    Ok(messages)
}

/// A streaming SSE reader.
pub struct SseClient {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: String,
    ready: std::collections::VecDeque<SseMessage>,
}

impl SseClient {
    /// Opens `url` (optionally with `Last-Event-ID`) and returns the raw
    /// response, whatever its status.
    pub async fn open(
        url: &str,
        token: Option<&str>,
        last_event_id: Option<i64>,
    ) -> Result<reqwest::Response> {
        let client = reqwest::Client::new();
        let mut request = client.get(url).header("accept", "text/event-stream");
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id.to_string());
        }
        request.send().await.with_context(|| format!("GET {url}"))
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
            let body = response.text().await.unwrap_or_default();
            bail!("GET {url} answered {status}: {body}");
        }
        Ok(Self {
            stream: response.bytes_stream().boxed(),
            buffer: String::new(),
            ready: std::collections::VecDeque::new(),
        })
    }

    /// The next message with data, `None` when the stream ended; fails when
    /// nothing arrives within `timeout`.
    pub async fn next_within(&mut self, timeout: Duration) -> Result<Option<SseMessage>> {
        loop {
            if let Some(message) = self.ready.pop_front() {
                return Ok(Some(message));
            }
            let chunk = tokio::time::timeout(timeout, self.stream.next())
                .await
                .with_context(|| format!("no SSE data within {timeout:?}"))?;
            match chunk {
                None => return Ok(None),
                Some(chunk) => {
                    let chunk = chunk.context("reading the SSE stream")?;
                    self.buffer.push_str(&String::from_utf8_lossy(&chunk));
                    self.ready.extend(take_messages(&mut self.buffer)?);
                }
            }
        }
    }
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
        let mut stream = socket
            .connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let authorization = token
            .map(|t| format!("authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "GET {path} HTTP/1.1\r\nhost: {addr}\r\naccept: text/event-stream\r\n{authorization}\r\n"
        );
        stream
            .write_all(request.as_bytes())
            .await
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
