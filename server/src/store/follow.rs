//! Keeps this process's fleet cache following what other processes write to
//! `devices`: woken by the table's `NOTIFY idem_devices` (skipping the
//! notifications of its own writes; unless `--follow-notifications false`),
//! and at least every `--follow-every` so a lost notification (a dropped
//! listener connection) only delays. The
//! catching up itself is the device writer's (`DeviceWriter::follow`).

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{Context, DeviceWriter, StoreError};
use crate::tuning::{CHANGE_LOG_KEPT, CHANGE_LOG_PRUNE_EVERY};

/// The channel the `devices` triggers notify.
pub const CHANNEL: &str = "idem_devices";

/// How the cache follows: at least `every`, and woken by notifications
/// when `notifications`.
#[derive(Debug, Clone, Copy)]
pub struct Following {
    pub every: Duration,
    pub notifications: bool,
}

/// Follows until `token` is cancelled.
pub async fn run(
    writer: Arc<DeviceWriter>,
    pool: PgPool,
    following: Following,
    token: CancellationToken,
) {
    let me = writer.id().to_string();
    let every = following.every;
    let mut listener = match following.notifications {
        false => None,
        true => match listen(&pool).await {
            Ok(listener) => Some(listener),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for other instances' device writes; following them every {every:?}");
                None
            }
        },
    };
    let mut ticks = 0u32;
    let mut timer = tokio::time::interval(every);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let woken_by_other = tokio::select! {
            () = token.cancelled() => return,
            _ = timer.tick() => true,
            notification = next(&mut listener) => match notification {
                Some(payload) => payload != me,
                None => {
                    // The listener failed: drop it and rely on the timer
                    // until it connects again.
                    listener = match following.notifications {
                        true => listen(&pool).await.ok(),
                        false => None,
                    };
                    true
                }
            },
        };
        if !woken_by_other {
            continue;
        }
        if let Err(e) = writer.follow().await {
            tracing::debug!(error = %e, "could not follow other instances' device writes; retrying");
        }
        ticks += 1;
        if ticks % CHANGE_LOG_PRUNE_EVERY == 0 {
            if let Err(e) = super::writer::prune_changes(&pool, CHANGE_LOG_KEPT).await {
                tracing::debug!(error = %e, "could not prune the device change log");
            }
        }
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener, StoreError> {
    let mut listener = PgListener::connect_with(pool)
        .await
        .context("connecting the device-writes listener")?;
    listener
        .listen(CHANNEL)
        .await
        .context("listening for device writes")?;
    Ok(listener)
}

/// The next notification's payload; `None` when the listener failed;
/// pending forever without a listener.
async fn next(listener: &mut Option<PgListener>) -> Option<String> {
    match listener {
        Some(listener) => match listener.recv().await {
            Ok(notification) => Some(notification.payload().to_owned()),
            Err(e) => {
                tracing::debug!(error = %e, "the device-writes listener failed");
                None
            }
        },
        None => std::future::pending().await,
    }
}
