//! The one writer of device rows and of the fleet cache: every change to
//! either goes through a [`DeviceTx`] from [`DeviceWriter::begin`], and the
//! cache mirrors a change only when that transaction has committed.
//!
//! The compiler keeps it so: the functions of `store::devices` that change
//! rows take a `&mut DeviceTx`, which only [`DeviceWriter::begin`] makes, and
//! the cache's one mutating method is private to `store`.
//!
//! Following other writers: every device row change gets the next version
//! and the writer's id (triggers of `devices`). Each transaction starts,
//! under the lock, by reading the highest version; when another process
//! wrote since this cache last looked, the rows it wrote (and the devices it
//! deleted) are read and replace their cache entries before anything else
//! happens in the transaction — so every write, and every decision taken
//! under the writer, sees the table as it is. [`DeviceWriter::follow`] does
//! only that (woken by the table's `NOTIFY`, or on a timer).
//!
//! Serialisation: device-writing transactions run one at a time, across
//! every server process sharing the database. Each takes, first, this
//! process's own queue (a mutex, so waiting writers hold no database
//! connection) and then a transaction-level PostgreSQL advisory lock
//! ([`DEVICE_WRITES_LOCK`]), released by the commit or the rollback. Batch
//! updates lock rows in whatever order PostgreSQL's plan visits them; two at
//! once could deadlock, one at a time cannot, and they are bound by the
//! database anyway.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};

use idem_protocol::DeviceId;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::{Mutex, MutexGuard};
use uuid::Uuid;

use super::cache::{FleetCache, FleetChange};
use super::{Context, StoreError};
use crate::reconcile::owned::OwnedResolver;

/// What the cache learnt from other writers in one look, for the engine.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Followed {
    /// Devices whose stored report is newer than the cache's was.
    pub reported: Vec<DeviceId>,
    /// Devices whose connection state changed.
    pub online: Vec<(DeviceId, bool)>,
    /// Devices whose desired generation changed.
    pub desired: Vec<DeviceId>,
    /// Devices another writer deleted.
    pub removed: Vec<DeviceId>,
}

impl Followed {
    pub fn is_empty(&self) -> bool {
        self.reported.is_empty()
            && self.online.is_empty()
            && self.desired.is_empty()
            && self.removed.is_empty()
    }
}

/// Told what the cache learnt from other writers (never blocks).
pub type FollowHook = Box<dyn Fn(Followed) + Send + Sync>;

/// The advisory lock key every device-writing transaction holds (any
/// constant works; this one spells "idem dev" in ASCII).
pub const DEVICE_WRITES_LOCK: i64 = 0x6964_656d_2064_6576;

/// The one owner of device writes. Not `Clone`: the server makes one and
/// shares it behind an `Arc`.
pub struct DeviceWriter {
    pool: PgPool,
    cache: Arc<FleetCache>,
    queue: Mutex<()>,
    /// This process's id in `devices.written_by`.
    id: Uuid,
    /// The cache holds every device change up to this version (changed
    /// only with `queue` held).
    seen: AtomicI64,
    hook: OnceLock<FollowHook>,
}

impl std::fmt::Debug for DeviceWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWriter")
            .field("id", &self.id)
            .field("seen", &self.seen)
            .finish_non_exhaustive()
    }
}

impl DeviceWriter {
    /// A writer whose cache holds every device change up to version `seen`
    /// ([`versions_high`], read before the cache was loaded).
    pub fn new(pool: PgPool, cache: Arc<FleetCache>, seen: i64) -> Self {
        Self {
            pool,
            cache,
            queue: Mutex::new(()),
            id: Uuid::new_v4(),
            seen: AtomicI64::new(seen),
            hook: OnceLock::new(),
        }
    }

    /// This process's id in `devices.written_by` (and in the `NOTIFY`
    /// payloads of its writes).
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// Sets what is told of other writers' changes (once; later calls are
    /// ignored).
    pub fn on_followed(&self, hook: FollowHook) {
        let _ = self.hook.set(hook);
    }

    /// [`DeviceWriter::begin`], then [`super::leases::check_fence`]: the
    /// transaction of a lease holder (the engine's), refused with
    /// `StoreError::LeaseLost` once the lease is not its own any more.
    pub async fn begin_fenced(
        &self,
        fence: Option<&super::leases::Fence>,
    ) -> Result<DeviceTx<'_>, StoreError> {
        let mut write = self.begin().await?;
        if let Some(fence) = fence {
            super::leases::check_fence(write.tx(), fence).await?;
        }
        Ok(write)
    }

    /// Brings the cache up to date with what other writers committed.
    pub async fn follow(&self) -> Result<(), StoreError> {
        let write = self.begin().await?;
        write.commit("following other writers").await
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
        let high: i64 = sqlx::query_scalar("SELECT idem_begin_device_write($1, $2)")
            .bind(DEVICE_WRITES_LOCK)
            .bind(self.id)
            .fetch_one(&mut *tx)
            .await
            .context("taking the device-writes lock")?;
        let seen = self.seen.load(Ordering::Acquire);
        if high > seen {
            let followed = self.catch_up(&mut tx, seen, high).await?;
            self.seen.store(high, Ordering::Release);
            if !followed.is_empty() {
                if let Some(hook) = self.hook.get() {
                    hook(followed);
                }
            }
        }
        Ok(DeviceTx {
            cache: &self.cache,
            seen: &self.seen,
            _turn: turn,
            tx,
            changes: Vec::new(),
        })
    }

    /// Replaces the cache entries of the devices other writers changed in
    /// versions `(seen, high]`, and drops those they deleted.
    async fn catch_up(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        seen: i64,
        high: i64,
    ) -> Result<Followed, StoreError> {
        let (rows, removed) = super::devices::written_by_others(tx, seen, high, self.id).await?;
        let ids: Vec<String> = rows.iter().map(|row| row.id.clone()).collect();
        let exempt: HashSet<String> = super::exemptions::exempt_devices(&mut **tx, Some(&ids))
            .await?
            .into_iter()
            .collect();
        let mut resolver = OwnedResolver::new((*self.cache.owned_set()).clone());
        let mut entries = super::devices::cache_entries(&rows, &mut resolver)?;
        let mut followed = Followed::default();
        let mut changes = Vec::with_capacity(entries.len() + removed.len());
        for id in removed {
            // Deleted and registered again in the same span: the row wins.
            if !ids.iter().any(|row| row == id.as_str()) && self.cache.contains(&id) {
                followed.removed.push(id.clone());
                changes.push(FleetChange::Removed(id));
            }
        }
        for (id, entry) in &mut entries {
            entry.exempt = exempt.contains(id.as_str());
            let before = self.cache.get(id);
            let seq =
                |e: &crate::reconcile::device::DeviceEntry| e.reported.as_ref().map(|r| r.seq);
            let generation = |e: &crate::reconcile::device::DeviceEntry| {
                e.desired.as_ref().map(|d| d.generation)
            };
            if before.as_ref().and_then(seq) != seq(entry) && entry.reported.is_some() {
                followed.reported.push(id.clone());
            }
            if let Some(online) = entry.online {
                if before.as_ref().and_then(|b| b.online) != Some(online) {
                    followed.online.push((id.clone(), online));
                }
            }
            if before.as_ref().and_then(generation) != generation(entry) {
                followed.desired.push(id.clone());
            }
        }
        changes.extend(
            entries
                .into_iter()
                .map(|(id, entry)| FleetChange::Followed(id, entry)),
        );
        self.cache.apply(changes);
        Ok(followed)
    }
}

/// The highest device version handed out so far: read before loading the
/// cache, it is where the cache's following of other writers starts.
pub async fn versions_high(pool: &PgPool) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT idem_device_versions_high()")
        .fetch_one(pool)
        .await
        .context("reading the highest device version")
}

/// One device-writing transaction: the only handle through which device
/// rows change, collecting the cache changes that mirror them.
pub struct DeviceTx<'w> {
    cache: &'w FleetCache,
    seen: &'w AtomicI64,
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
            seen,
            _turn,
            mut tx,
            changes,
        } = self;
        // With the lock held, every version handed out since this
        // transaction began is its own: the cache mirrors them below.
        let high: i64 = sqlx::query_scalar("SELECT idem_device_versions_high()")
            .fetch_one(&mut *tx)
            .await
            .context(what)?;
        tx.commit().await.context(what)?;
        seen.store(high, Ordering::Release);
        cache.apply(changes);
        Ok(())
    }
}
