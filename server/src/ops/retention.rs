//! Retention of what grows with every run: completed runs with their
//! per-device targets, and the attempt history, pruned by age and size once
//! a minute (the event log has its own pruning in the relay).
//!
//! Deletes in bounded batches so one prune never holds long locks; never
//! touches a run that is still running.

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::store;

pub use crate::config::RunRetention;
use crate::tuning::{RETENTION_PRUNE_INTERVAL, RETENTION_RUN_BATCH};

/// Prunes once now, then every [`RETENTION_PRUNE_INTERVAL`] until cancelled.
pub async fn run(pool: PgPool, limits: RunRetention, token: CancellationToken) {
    let mut tick = tokio::time::interval(RETENTION_PRUNE_INTERVAL);
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            _ = tick.tick() => prune(&pool, limits, &token).await,
        }
    }
}

/// One pass over every limit; failures are logged and retried next time.
pub async fn prune(pool: &PgPool, limits: RunRetention, token: &CancellationToken) {
    let mut runs = 0;
    loop {
        match store::runs::prune(
            pool,
            limits.max_age,
            limits.max_targets,
            RETENTION_RUN_BATCH,
        )
        .await
        {
            Ok(n) => {
                runs += n;
                if n < RETENTION_RUN_BATCH as u64 || token.is_cancelled() {
                    break;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "pruning runs failed; retrying at the next pass");
                break;
            }
        }
    }
    if runs > 0 {
        tracing::info!(runs, "pruned old runs and their targets");
    }
    match store::devices::prune_attempts(pool, limits.attempts_max_age, limits.attempts_max_count)
        .await
    {
        Ok(0) => {}
        Ok(n) => tracing::info!(attempts = n, "pruned attempt history"),
        Err(e) => tracing::warn!(error = %e, "pruning attempt history failed"),
    }
    match store::access::prune_audit(pool, limits.audit_max_age).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(records = n, "pruned the audit trail"),
        Err(e) => tracing::warn!(error = %e, "pruning the audit trail failed"),
    }
}
