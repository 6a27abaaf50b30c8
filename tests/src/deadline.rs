//! Deadlines for the harness's waits: each wait takes one deadline up
//! front, checks it whatever arrives meanwhile (a keep-alive, a message that
//! is not the one awaited, a poll that answers "not yet"), and fails with an
//! error naming what it waited for once the deadline passes.
//!
//! Owns no service and starts nothing; it only bounds futures.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

/// The moment a wait gives up, and the limit it was given (for messages).
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    limit: Duration,
}

impl Deadline {
    /// A deadline `limit` from now.
    pub fn after(limit: Duration) -> Self {
        Self {
            at: Instant::now() + limit,
            limit,
        }
    }

    /// How long the wait was given in all.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// Whether the deadline has passed.
    pub fn has_passed(&self) -> bool {
        Instant::now() >= self.at
    }

    /// The time left, zero once passed.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// The output of `future` if it is ready before the deadline, else an
    /// error saying `what` did not happen within the limit.
    pub async fn run<F: Future>(&self, what: impl Display, future: F) -> Result<F::Output> {
        tokio::time::timeout_at(self.at.into(), future)
            .await
            .map_err(|_| anyhow!("{what}: not within {:?}", self.limit))
    }
}

/// [`Deadline::run`] with a deadline `limit` from now.
pub async fn within<F: Future>(
    limit: Duration,
    what: impl Display,
    future: F,
) -> Result<F::Output> {
    Deadline::after(limit).run(what, future).await
}

/// Waits until `done` holds, checking every 50 ms, all under one deadline:
/// a check that hangs counts against it too. The error names `what`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut done: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Deadline::after(limit);
    deadline
        .run(what, async {
            while !done().await {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
}

/// How long a test waits for its turn under a one-at-a-time lock: longer
/// than every test of its group together should take.
pub const TURN_LIMIT: Duration = Duration::from_secs(15 * 60);

/// A turn under `lock`, the lock that makes the tests of `group` run one at
/// a time inside one test process, waited for at most [`TURN_LIMIT`]. (The
/// runner of `scripts/test` starts a process per test and runs these groups
/// alone anyway: `.config/nextest.toml`.)
pub async fn turn<'a>(
    lock: &'a tokio::sync::Mutex<()>,
    group: &str,
) -> Result<tokio::sync::MutexGuard<'a, ()>> {
    within(
        TURN_LIMIT,
        format!("a turn among the {group}, which run one at a time (the test holding it hangs?)"),
        lock.lock(),
    )
    .await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_future_that_never_ends_fails_at_the_deadline_naming_what_was_awaited() {
        let started = Instant::now();
        let error = within(
            Duration::from_millis(100),
            "the answer that never comes",
            std::future::pending::<()>(),
        )
        .await
        .unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert_eq!(
            error.to_string(),
            "the answer that never comes: not within 100ms"
        );
    }

    #[tokio::test]
    async fn a_condition_whose_check_hangs_still_ends_at_the_deadline() {
        let error = within(
            Duration::from_secs(5),
            "the bounded wait itself",
            wait_until(Duration::from_millis(100), "a hanging check", || {
                std::future::pending::<bool>()
            }),
        )
        .await
        .unwrap()
        .unwrap_err();
        assert_eq!(error.to_string(), "a hanging check: not within 100ms");
    }

    #[tokio::test]
    async fn a_condition_that_holds_ends_the_wait_at_once() {
        let mut checks = 0;
        wait_until(Duration::from_secs(5), "the third check", || {
            checks += 1;
            std::future::ready(checks >= 3)
        })
        .await
        .unwrap();
        assert_eq!(checks, 3);
    }
}
