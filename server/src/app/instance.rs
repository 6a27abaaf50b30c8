//! The instance name's claim: at start-up this process takes its name in the
//! `instances` table, or refuses to start while another live process holds
//! it; a heartbeat keeps the claim, a graceful stop gives it up.
//!
//! A holder is live while its heartbeat is younger than its lease. A
//! process starting on the same host as a holder whose PID is gone (a crash,
//! then a restart) takes the name at once; otherwise it waits up to the
//! holder's lease for the claim to go stale, and refuses to start if the
//! holder kept beating (the MQTT client id `idem-server:{instance}` would
//! otherwise be shared, and the broker would keep disconnecting one of the two).

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::store::instances::{self, Claimant, Holder};
use crate::store::StoreError;
use crate::tuning::INSTANCE_CLAIM_RETRY;

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error(
        "the instance name {name:?} is in use by a live idem-server (pid {pid} on host {host:?}, \
         started {age:.0}s ago, last heartbeat {beat:.1}s ago): give this process another \
         IDEM_INSTANCE / --instance, or stop that one",
        pid = holder.pid, host = holder.host, age = holder.age_secs, beat = holder.heartbeat_age_secs
    )]
    InUse { name: String, holder: Holder },
    #[error(
        "the live instance {other:?} runs with --require-approval={theirs} and this one with \
         --require-approval={ours}: whether every desired change needs approval is one setting \
         of the fleet; start every instance with the same IDEM_REQUIRE_APPROVAL / \
         --require-approval"
    )]
    ApprovalDisagrees {
        other: String,
        theirs: bool,
        ours: bool,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Records this instance's `--require-approval` with its claim, and
/// refuses (giving the claim back) when a live instance's differs: every
/// instance of a fleet judges approval alike.
pub async fn agree_on_approval(
    pool: &PgPool,
    claim: &InstanceClaim,
    require_approval: bool,
) -> Result<(), InstanceError> {
    let holder = claim.claimant.holder;
    let differing =
        instances::record_require_approval(pool, &claim.name, holder, require_approval).await?;
    let Some((other, theirs)) = differing else {
        return Ok(());
    };
    instances::release(pool, &claim.name, holder).await?;
    Err(InstanceError::ApprovalDisagrees {
        other,
        theirs,
        ours: require_approval,
    })
}

/// This process's claim of its instance name.
#[derive(Debug, Clone)]
pub struct InstanceClaim {
    pub name: String,
    pub claimant: Claimant,
}

/// This machine's host name (empty when it cannot be read: then no holder is
/// ever taken for one on this host).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// Whether `holder` is a process of this host that no longer runs (or this
/// very PID, reused by a restarted container).
fn is_dead_on_this_host(holder: &Holder, host: &str) -> bool {
    !host.is_empty()
        && holder.host == host
        && (holder.pid == std::process::id()
            || !std::path::Path::new(&format!("/proc/{}", holder.pid)).exists())
}

/// Claims `name` for this process: at once when it is free, stale or held by
/// a dead process of this host; after waiting up to the holder's lease when
/// the holder may have died elsewhere; never while the holder keeps beating.
pub async fn claim(
    pool: &PgPool,
    name: &str,
    lease: Duration,
) -> Result<InstanceClaim, InstanceError> {
    let claimant = Claimant {
        holder: Uuid::new_v4(),
        host: host_name(),
        pid: std::process::id(),
        lease,
    };
    let claim = InstanceClaim {
        name: name.to_owned(),
        claimant,
    };
    if instances::claim(pool, name, &claim.claimant, None).await? {
        return Ok(claim);
    }
    let Some(first) = instances::holder(pool, name).await? else {
        // Released between the two statements: free now.
        return claim_again(pool, claim).await;
    };
    if is_dead_on_this_host(&first, &claim.claimant.host) {
        tracing::info!(
            name,
            pid = first.pid,
            "the instance name's holder on this host is gone; taking the name over"
        );
        if instances::claim(pool, name, &claim.claimant, Some(first.holder)).await? {
            return Ok(claim);
        }
    }
    tracing::info!(
        name,
        pid = first.pid,
        host = %first.host,
        heartbeat_age_secs = first.heartbeat_age_secs,
        "the instance name is claimed; waiting up to its lease to see whether the holder is alive"
    );
    let waited_from = tokio::time::Instant::now();
    let limit = first.lease + INSTANCE_CLAIM_RETRY;
    loop {
        tokio::time::sleep(INSTANCE_CLAIM_RETRY).await;
        if instances::claim(pool, name, &claim.claimant, None).await? {
            return Ok(claim);
        }
        if waited_from.elapsed() >= limit {
            let holder = instances::holder(pool, name).await?.unwrap_or(first);
            return Err(InstanceError::InUse {
                name: name.to_owned(),
                holder,
            });
        }
    }
}

async fn claim_again(pool: &PgPool, claim: InstanceClaim) -> Result<InstanceClaim, InstanceError> {
    if instances::claim(pool, &claim.name, &claim.claimant, None).await? {
        return Ok(claim);
    }
    match instances::holder(pool, &claim.name).await? {
        Some(holder) => Err(InstanceError::InUse {
            name: claim.name,
            holder,
        }),
        None => Err(InstanceError::Store(StoreError::Corrupt {
            context: "claiming the instance name",
            detail: "the name was neither free nor held".into(),
        })),
    }
}

/// What a graceful stop does with the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtStop {
    /// Delete it: the name is free.
    Release,
    /// Leave it stale: a survivor drains the MQTT session this process
    /// leaves behind (`--share-group`), then deletes it.
    LeaveForDrain,
}

/// Beats every quarter of the lease until `beats` is cancelled, then gives
/// the name up as `at_stop` says. When another process took the name over
/// (this one was paused past its lease), stops the server through `server`.
pub async fn keep(
    pool: PgPool,
    claim: InstanceClaim,
    at_stop: AtStop,
    beats: CancellationToken,
    server: CancellationToken,
) {
    let every = claim.claimant.lease / 4;
    loop {
        tokio::select! {
            () = beats.cancelled() => break,
            () = tokio::time::sleep(every) => {}
        }
        match instances::heartbeat(&pool, &claim.name, claim.claimant.holder).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::error!(
                    name = %claim.name,
                    "another process took this instance name over (this one missed its heartbeats for longer than the lease); stopping"
                );
                server.cancel();
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not renew the instance heartbeat; retrying")
            }
        }
    }
    let given_up = match at_stop {
        AtStop::Release => instances::release(&pool, &claim.name, claim.claimant.holder).await,
        AtStop::LeaveForDrain => {
            instances::mark_stopped(&pool, &claim.name, claim.claimant.holder).await
        }
    };
    if let Err(e) = given_up {
        tracing::warn!(error = %e, "could not give the instance name up; it goes stale after its lease");
    }
}
