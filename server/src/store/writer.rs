//! The one writer of device rows and of the fleet cache: every change to
//! either goes through a [`DeviceTx`] from [`DeviceWriter::begin`], and the
//! cache mirrors a change only when that transaction has committed.
//!
//! The compiler keeps it so: the functions of `store::devices` that change
//! rows take a `&mut DeviceTx`, which only [`DeviceWriter::begin`] makes, and
//! the cache's one mutating method is private to `store`.
//!
//! Serialisation: device-writing transactions run one at a time, across
//! every server process sharing the database. Each takes, first, this
//! process's own queue (a mutex, so waiting writers hold no database
//! connection) and then a transaction-level PostgreSQL advisory lock
//! ([`DEVICE_WRITES_LOCK`]), released by the commit or the rollback. Batch
//! updates lock rows in whatever order PostgreSQL's plan visits them; two at
//! once could deadlock, one at a time cannot, and they are bound by the
//! database anyway.

use std::sync::Arc;

use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::{Mutex, MutexGuard};

use super::cache::{FleetCache, FleetChange};
use super::{Context, StoreError};

/// The advisory lock key every device-writing transaction holds (any
/// constant works; this one spells "idem dev" in ASCII).
pub const DEVICE_WRITES_LOCK: i64 = 0x6964_656d_2064_6576;

/// The one owner of device writes. Not `Clone`: the server makes one and
/// shares it behind an `Arc`.
#[derive(Debug)]
pub struct DeviceWriter {
    pool: PgPool,
    cache: Arc<FleetCache>,
    queue: Mutex<()>,
}

impl DeviceWriter {
    pub fn new(pool: PgPool, cache: Arc<FleetCache>) -> Self {
        Self {
            pool,
            cache,
            queue: Mutex::new(()),
        }
    }

    /// The cache this writer keeps, to read.
    pub fn cache(&self) -> &Arc<FleetCache> {
        &self.cache
    }

    /// Waits for this process's turn, starts a transaction and takes the
    /// database-wide device-writes lock in it.
    pub async fn begin(&self) -> Result<DeviceTx<'_>, StoreError> {
        let turn = self.queue.lock().await;
        let mut tx = self.pool.begin().await.context("starting a transaction")?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(DEVICE_WRITES_LOCK)
            .execute(&mut *tx)
            .await
            .context("taking the device-writes lock")?;
        Ok(DeviceTx {
            cache: &self.cache,
            _turn: turn,
            tx,
            changes: Vec::new(),
        })
    }
}

/// One device-writing transaction: the only handle through which device
/// rows change, collecting the cache changes that mirror them.
pub struct DeviceTx<'w> {
    cache: &'w FleetCache,
    /// Held until the cache mirrors the commit, so the cache sees commits
    /// in their order.
    _turn: MutexGuard<'w, ()>,
    tx: Transaction<'static, Postgres>,
    changes: Vec<FleetChange>,
}

impl std::fmt::Debug for DeviceTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTx")
            .field("changes", &self.changes.len())
            .finish_non_exhaustive()
    }
}

impl DeviceTx<'_> {
    /// The transaction, for rows that are not device rows (runs, events,
    /// the audit trail) written atomically with the device change.
    pub fn tx(&mut self) -> &mut Transaction<'static, Postgres> {
        &mut self.tx
    }

    /// The cache as it stands (committed changes only), to read.
    pub fn cache(&self) -> &FleetCache {
        self.cache
    }

    /// Cache changes to make once this transaction has committed.
    pub fn mirror(&mut self, changes: impl IntoIterator<Item = FleetChange>) {
        self.changes.extend(changes);
    }

    /// Commits (`what` names the write in an error), then mirrors the
    /// collected changes in the cache; on failure nothing is mirrored.
    pub async fn commit(self, what: &'static str) -> Result<(), StoreError> {
        let Self {
            cache,
            _turn,
            tx,
            changes,
        } = self;
        tx.commit().await.context(what)?;
        cache.apply(changes);
        Ok(())
    }
}
