//! Survivors drain what a gone instance's MQTT session holds (only with
//! `--share-group`): every quarter of its lease this instance looks for a
//! stale instance claim (a process killed or stopped while sharing the
//! fleet's subscriptions), takes it, drains that session into its own
//! ingest (`crate::mqtt::adopt`) and deletes the claim. One survivor drains
//! each session; a drain cut short leaves the claim to go stale again.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::app::instance::host_name;
use crate::config::ValidConfig;
use crate::mqtt::adopt::{drain_session, DrainError, Drained};
use crate::mqtt::intake::IntakeSender;
use crate::ops::metrics::Metrics;
use crate::store::instances::{self, Claimant};
use crate::tuning::SESSION_DRAIN_MIN_LOOK_EVERY;

pub struct SessionDrains {
    pub pool: PgPool,
    pub config: ValidConfig,
    pub intake: IntakeSender,
    pub metrics: Arc<Metrics>,
}

impl SessionDrains {
    pub async fn run(self, token: CancellationToken) {
        let lease = self.config.fleet.instance_lease;
        let every = (lease / 4).max(SESSION_DRAIN_MIN_LOOK_EVERY);
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            let claimant = Claimant {
                holder: Uuid::new_v4(),
                host: host_name(),
                pid: std::process::id(),
                lease,
            };
            let me = &self.config.fleet.instance;
            let name = match instances::take_stale_for_drain(&self.pool, me, &claimant).await {
                Ok(Some(name)) => name,
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "could not look for gone instances");
                    continue;
                }
            };
            tracing::info!(gone = %name, "an instance stopped or died; draining its MQTT session");
            match self.drain(&name, claimant.holder, every, &token).await {
                Ok(drained) => {
                    self.metrics.sessions_drained.increment(1);
                    self.metrics.drained_messages.increment(drained.messages);
                    tracing::info!(
                        gone = %name,
                        session_present = drained.session_present,
                        messages = drained.messages,
                        "drained and removed the MQTT session of a gone instance"
                    );
                    if let Err(e) = instances::release(&self.pool, &name, claimant.holder).await {
                        tracing::warn!(error = %e, gone = %name, "could not delete a drained instance's claim; it is drained again once stale");
                    }
                }
                Err(DrainError::Cancelled) => return,
                Err(e) => {
                    tracing::warn!(error = %e, gone = %name, "draining a gone instance's session failed; it is tried again once its claim is stale");
                }
            }
        }
    }

    /// Drains `name`'s session, renewing the hold on its claim meanwhile.
    async fn drain(
        &self,
        name: &str,
        holder: Uuid,
        every: Duration,
        token: &CancellationToken,
    ) -> Result<Drained, DrainError> {
        let drain = drain_session(&self.config, name, &self.intake, token);
        tokio::pin!(drain);
        loop {
            tokio::select! {
                drained = &mut drain => return drained,
                () = tokio::time::sleep(every) => {
                    if let Err(e) = instances::heartbeat(&self.pool, name, holder).await {
                        tracing::debug!(error = %e, "could not renew the hold on a drained claim");
                    }
                }
            }
        }
    }
}
