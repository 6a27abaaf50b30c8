//! Reads whose answers can be large — a plan's devices with their field
//! diffs, device pages with their specs — taken in turns, so that however
//! many such calls arrive the server holds only a few pages at once: at
//! most [`PER_TOKEN`] at a time for one operator token (one more is `429
//! too_many_large_reads`, with `Retry-After`), and at most [`AT_ONCE`] of
//! all callers together (one more waits up to [`LARGE_READ_WAIT`] for its turn, then
//! `503 large_reads_busy`). Each page is bounded by bytes too
//! ([`MAX_PAGE_BYTES`]).
//!
//! Owns the turns only; it reads nothing itself.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_protocol::api::ErrorCode;
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::http::error::ApiError;
use crate::tuning::LARGE_READ_WAIT;

/// A page of large items stops growing once its JSON reaches this many
/// bytes (it always holds at least one item); its cursor continues it.
pub const MAX_PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Large reads one operator token may have in progress at once.
pub const PER_TOKEN: usize = 2;
/// Large reads in progress at once, of every caller together.
pub const AT_ONCE: usize = 4;
/// `Retry-After` of a refused large read, in seconds.
const RETRY_AFTER_SECONDS: u32 = 1;

/// The turns of large reads in progress.
#[derive(Debug)]
pub struct LargeReads {
    at_once: Semaphore,
    /// Token name → large reads of it in progress.
    per_token: Mutex<HashMap<String, usize>>,
}

impl Default for LargeReads {
    fn default() -> Self {
        Self {
            at_once: Semaphore::new(AT_ONCE),
            per_token: Mutex::new(HashMap::new()),
        }
    }
}

/// One large read's turn: given back when dropped.
#[derive(Debug)]
pub struct Turn<'a> {
    reads: &'a LargeReads,
    token: String,
    _permit: SemaphorePermit<'a>,
}

/// Why a large read got no turn.
#[derive(Debug)]
pub enum NoTurn {
    PerToken,
    Busy,
}

impl LargeReads {
    /// A turn for a large read by `token` (the operator token's name).
    pub async fn turn(&self, token: &str) -> Result<Turn<'_>, NoTurn> {
        {
            let mut held = self.lock();
            let count = held.entry(token.to_owned()).or_insert(0);
            if *count >= PER_TOKEN {
                return Err(NoTurn::PerToken);
            }
            *count += 1;
        }
        let permit = match tokio::time::timeout(LARGE_READ_WAIT, self.at_once.acquire()).await {
            Ok(Ok(permit)) => permit,
            // Timed out, or closed (never: the semaphore is never closed).
            Ok(Err(_)) | Err(_) => {
                self.give_back(token);
                return Err(NoTurn::Busy);
            }
        };
        Ok(Turn {
            reads: self,
            token: token.to_owned(),
            _permit: permit,
        })
    }

    /// [`LargeReads::turn`] for the caller's operator token (callers
    /// without one share a turn's count), or the refusal to answer with.
    pub async fn turn_for(&self, token: Option<&str>) -> Result<Turn<'_>, Response> {
        self.turn(token.unwrap_or("anonymous"))
            .await
            .map_err(NoTurn::answer)
    }

    fn give_back(&self, token: &str) {
        let mut held = self.lock();
        if let Some(count) = held.get_mut(token) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(token);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        // Each change is one step under the lock: a panic cannot leave it
        // half-made.
        self.per_token
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.reads.give_back(&self.token);
    }
}

impl NoTurn {
    /// The refusal, with `Retry-After`.
    pub fn answer(self) -> Response {
        let error = match self {
            NoTurn::PerToken => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                ErrorCode::TooManyLargeReads,
                format!(
                    "this token has {PER_TOKEN} large reads (plan or device pages) in progress, \
                     the most one token may have at once; wait for one to finish"
                ),
            ),
            NoTurn::Busy => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::LargeReadsBusy,
                format!(
                    "{AT_ONCE} large reads (plan or device pages) are in progress, the most the \
                     server serves at once, and none ended within {LARGE_READ_WAIT:?}; retry later"
                ),
            ),
        };
        let mut response = error.into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        response
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_token_gets_its_share_of_turns_and_gets_them_back_when_they_end() {
        let reads = LargeReads::default();
        let first = reads.turn("viewer").await.unwrap();
        let _second = reads.turn("viewer").await.unwrap();
        assert!(matches!(reads.turn("viewer").await, Err(NoTurn::PerToken)));
        // Another token still has its own.
        let _other = reads.turn("other").await.unwrap();
        drop(first);
        assert!(reads.turn("viewer").await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_turns_of_every_caller_a_read_waits_then_is_refused_as_busy() {
        let reads = LargeReads::default();
        let mut held = Vec::new();
        for i in 0..AT_ONCE {
            held.push(reads.turn(&format!("t{i}")).await.unwrap());
        }
        assert!(matches!(reads.turn("late").await, Err(NoTurn::Busy)));
        // The refused read gave its own token's count back.
        assert!(reads.lock().get("late").is_none());
        held.pop();
        assert!(reads.turn("late").await.is_ok());
    }
}
