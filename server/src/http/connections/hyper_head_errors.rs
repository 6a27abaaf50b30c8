//! hyper's own answers to request heads it refused (`400`, `414`, `431`,
//! with an empty body), recognised in the connection's output and replaced
//! by the API's JSON error ([`JsonHeadErrors`]); the refused connection is
//! then read a little longer so closing it does not reset the answer away.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::HeadRejection;
use crate::tuning::REFUSED_HEAD_LINGER;

/// Most bytes read and discarded in that time.
const REFUSED_HEAD_LINGER_BYTES: usize = 1024 * 1024;

/// A connection's stream as hyper sees it. hyper answers a request head it
/// cannot take itself, before any handler runs and with an empty body: `400`
/// for one it cannot parse, `431` for a head over [`super::MAX_HEAD_BYTES`] or with
/// more than [`super::MAX_HEADER_FIELDS`] fields, `414` for a target over 65,534
/// bytes (which cannot fit in such a head; recognised all the same). This wrapper recognises such an answer as hyper writes it (one
/// of those statuses with `content-length: 0` at the start of a write: the
/// API's own error answers always carry a JSON body, and JSON and SSE bodies
/// never hold a bare CR LF) and writes the API's JSON error in its place;
/// hyper closes the connection after it.
pub(super) struct JsonHeadErrors<S> {
    inner: S,
    /// Our answer in place of hyper's, and how much of it is written.
    replacement: Option<(Vec<u8>, usize)>,
    /// Set once hyper's answer was replaced.
    pub(super) replaced: Option<HeadRejection>,
}

impl<S> JsonHeadErrors<S> {
    pub(super) fn new(inner: S) -> Self {
        Self {
            inner,
            replacement: None,
            replaced: None,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> JsonHeadErrors<S> {
    /// Takes `head` (hyper's answer) as written when it is one to replace.
    fn replace(&mut self, head: &[u8]) -> Option<usize> {
        if self.replaced.is_some() {
            return None;
        }
        let (rejection, len) = hyper_error_answer(head)?;
        self.replaced = Some(rejection);
        self.replacement = Some((rejection.error().to_http(None), 0));
        Some(len)
    }

    /// Writes what is left of the replacement answer.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((answer, written)) = self.replacement.as_mut() {
            if *written == answer.len() {
                self.replacement = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &answer[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }

    /// After a replaced answer: writes what is left of it, then reads and
    /// discards what the client still sends for a while, so that closing
    /// does not reset the connection before the client has read the answer.
    pub(super) async fn finish_refusal(&mut self) {
        let sent = async {
            std::future::poll_fn(|cx| self.poll_replacement(cx)).await?;
            self.inner.flush().await?;
            self.inner.shutdown().await
        };
        if !matches!(
            tokio::time::timeout(REFUSED_HEAD_LINGER, sent).await,
            Ok(Ok(()))
        ) {
            return;
        }
        let mut sink = vec![0_u8; 8_192];
        let mut drained = 0;
        let drain = async {
            while drained < REFUSED_HEAD_LINGER_BYTES {
                match self.inner.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => drained += n,
                }
            }
        };
        let _ = tokio::time::timeout(REFUSED_HEAD_LINGER, drain).await;
    }
}

/// hyper's own answer to a head it refused, at the start of `written`:
/// which one it is and its length (it has no body).
pub(super) fn hyper_error_answer(written: &[u8]) -> Option<(HeadRejection, usize)> {
    let status = written
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| written.strip_prefix(b"HTTP/1.0 "))?;
    let rejection = match status.get(..4)? {
        b"400 " => HeadRejection::Malformed,
        b"414 " => HeadRejection::UriTooLong,
        b"431 " => HeadRejection::HeadersTooLarge,
        _ => return None,
    };
    let end = written.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = written[..end].to_ascii_lowercase();
    let empty = head
        .windows(b"\r\ncontent-length: 0\r\n".len())
        .any(|w| w == b"\r\ncontent-length: 0\r\n");
    empty.then_some((rejection, end))
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonHeadErrors<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for JsonHeadErrors<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        if let Some(taken) = this.replace(buf) {
            return Poll::Ready(Ok(taken));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        // hyper keeps a message head in a buffer of its own: it is the first
        // slice of a write.
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            if let Some(taken) = this.replace(first) {
                return Poll::Ready(Ok(taken));
            }
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}
