//! The end of drift exemptions that expire: once a second, expired rows are
//! deleted and the cache's exemption flags follow in the same device write;
//! the engine then reconciles the devices that drifted while exempt.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::reconcile::machine::EngineCommand;
use crate::store::cache::FleetCache;
use crate::store::{self, DeviceWriter, StoreError};
use crate::tuning::EXEMPTION_SWEEP_INTERVAL;

/// What ending exemptions takes: the table, the device writer (the cache
/// changes only through it) and the engine to tell.
pub struct Sweeper {
    pub pool: PgPool,
    pub writer: Arc<DeviceWriter>,
    pub fleet: Arc<FleetCache>,
    pub engine: mpsc::Sender<EngineCommand>,
}

/// Ends expired exemptions every [`EXEMPTION_SWEEP_INTERVAL`] until cancelled.
pub async fn run(state: Sweeper, token: CancellationToken) {
    let mut tick = tokio::time::interval(EXEMPTION_SWEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Err(e) = sweep(&state).await {
            tracing::warn!(error = %e, "could not end expired exemptions; trying again");
        }
    }
}

async fn sweep(state: &Sweeper) -> Result<(), StoreError> {
    if !store::exemptions::any_expired(&state.pool).await? {
        return Ok(());
    }
    let mut write = state.writer.begin().await?;
    let deleted = store::exemptions::delete_expired(&mut write).await?;
    // Expiry only ends exemptions; `started` is empty here.
    let ended = store::exemptions::refresh(&mut write, &state.fleet, store::Scope::All)
        .await?
        .ended;
    write.commit("ending expired exemptions").await?;
    tracing::info!(
        exemptions = deleted,
        devices = ended.len(),
        "exemptions expired"
    );
    if !ended.is_empty() {
        // An engine that has stopped is not told: its next start reads the
        // cache, and the next resync reconciles the devices.
        let _ = state
            .engine
            .send(EngineCommand::ExemptionsEnded(ended))
            .await;
    }
    Ok(())
}
