//! The one writer of device rows and of the fleet cache: every change to
//! either goes through a [`DeviceTx`] from [`DeviceWriter::begin`], and the
//! cache mirrors a change only when that transaction has committed.
//!
//! The compiler keeps it so: the functions of `store::devices` that change
//! rows take a `&mut DeviceTx`, which only [`DeviceWriter::begin`] makes, and
//! the cache's one mutating method is private to `store`.
//!
//! Following other writers: a transaction whose changes the cache mirrors
//! appends one entry to `device_changes` (the next version, its writer's
//! id, the devices it changed, or "every device" for a new declaration of
//! owned fields) and notifies `idem_devices`. Each transaction starts, under
//! the lock, by reading the last version; when another process wrote since
//! this cache last looked, the rows of the devices it named are read and
//! replace their cache entries (a device without a row any more is dropped)
//! before anything else happens in the transaction — so every write, and
//! every decision taken under the writer, sees the table as it is.
//! [`DeviceWriter::follow`] does only that (woken by the `NOTIFY`, or on a
//! timer).
//!
//! Serialisation: device-writing transactions run one at a time, across
//! every server process sharing the database. Each takes, first, this
//! process's own queue (a mutex, so waiting writers hold no database
//! connection) and then a transaction-level PostgreSQL advisory lock
//! ([`DEVICE_WRITES_LOCK`]), released by the commit or the rollback. Batch
//! updates lock rows in whatever order PostgreSQL's plan visits them; two at
//! once could deadlock, one at a time cannot, and they are bound by the
//! database anyway.
//!
//! Publishes against desired changes: a transaction whose changes are not
//! only the engine's columns or reports (a desired spec, owned fields, an
//! exemption, a deletion: what a push carries) also takes
//! [`DESIRED_CHANGES_LOCK`] before it commits, and the engine hands a batch
//! of publishes to the broker under a [`DesiredHold`], the same lock held
//! shared: such a change commits before the hold was taken (the hold then
//! says whether the cache has it) or after the batch left.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};

use idem_protocol::DeviceId;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::{Mutex, MutexGuard};
use uuid::Uuid;

use super::cache::{FleetCache, FleetChange};
use super::{Context, StoreError};
use crate::reconcile::decide::ReportedState;
use crate::reconcile::owned::OwnedResolver;

/// What the cache learnt from other writers in one look, for the engine.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Followed {
    /// Devices whose stored report is newer than the cache's was.
    pub reported: Vec<DeviceId>,
    /// Devices whose connection state changed.
    pub online: Vec<(DeviceId, bool)>,
    /// Devices another writer deleted.
    pub removed: Vec<DeviceId>,
    /// Devices an exemption now covers that none did.
    pub exemptions_started: Vec<DeviceId>,
    /// Devices whose exemptions another writer ended (expired or deleted).
    pub exemptions_ended: Vec<DeviceId>,
}

impl Followed {
    pub fn is_empty(&self) -> bool {
        self.reported.is_empty()
            && self.online.is_empty()
            && self.removed.is_empty()
            && self.exemptions_started.is_empty()
            && self.exemptions_ended.is_empty()
    }
}

/// Told what the cache learnt from other writers (never blocks).
pub type FollowHook = Box<dyn Fn(Followed) + Send + Sync>;

/// The advisory lock key every device-writing transaction holds (any
/// constant works; this one spells "idem dev" in ASCII).
pub const DEVICE_WRITES_LOCK: i64 = 0x6964_656d_2064_6576;

/// The advisory lock key that orders publishes of desired state with the
/// changes of what they carry ("idem des").
pub const DESIRED_CHANGES_LOCK: i64 = 0x6964_656d_2064_6573;

/// While it lives, no writer can commit a change of what a push carries:
/// publishes decided on the cache that took it carry the desired state as
/// committed. A transaction-level lock on a pooled connection, taken with
/// its `BEGIN` in one round trip: released by [`DesiredHold::release`]
/// (`COMMIT`); a hold dropped without it closes its connection instead (the
/// session's end releases the lock), so no connection goes back to the
/// pool inside the transaction. A paused holder's session ends once it has
/// been idle in the transaction past the pool's limit (the instance lease).
#[derive(Debug)]
pub struct DesiredHold {
    connection: Option<PoolConnection<Postgres>>,
}

impl DesiredHold {
    /// Lets the changes the hold kept back commit.
    pub async fn release(mut self) -> Result<(), StoreError> {
        let Some(mut connection) = self.connection.take() else {
            return Ok(());
        };
        let unlocked = sqlx::query("COMMIT").execute(&mut *connection).await;
        match unlocked {
            Ok(_) => Ok(()),
            Err(e) => {
                drop(connection.detach());
                Err(e).context("releasing the hold on desired changes")
            }
        }
    }
}

impl Drop for DesiredHold {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            drop(connection.detach());
        }
    }
}

/// The one owner of device writes. Not `Clone`: the server makes one and
/// shares it behind an `Arc`.
pub struct DeviceWriter {
    pool: PgPool,
    cache: Arc<FleetCache>,
    queue: Mutex<()>,
    /// This process's id in `device_changes.writer`.
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

    /// This process's id in `device_changes.writer` (and in the `NOTIFY`
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

    /// Whether a device change was committed that this cache has not
    /// caught up with (one read of the change log's last version, without
    /// the device-writes lock). What is committed after the read is not
    /// seen.
    pub async fn overtaken(&self) -> Result<bool, StoreError> {
        let high: i64 = sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM device_changes")
            .fetch_one(&self.pool)
            .await
            .context("reading the device change log's last version")?;
        Ok(high > self.seen.load(Ordering::Acquire))
    }

    /// Holds back every change of what a push carries and says whether
    /// this cache has all those committed so far: the hold when it has,
    /// `None` when another writer's change is missing (the caller catches
    /// up with [`Self::follow`], which needs the hold released, and asks
    /// again).
    pub async fn hold_desired(&self) -> Result<Option<DesiredHold>, StoreError> {
        let mut connection = self
            .pool
            .acquire()
            .await
            .context("taking a connection for a hold on desired changes")?;
        // One round trip: a simple query (the only kind that carries two
        // statements, so the constant key is written into its text).
        let hold_desired = format!("BEGIN; SELECT idem_hold_desired({DESIRED_CHANGES_LOCK})");
        let executor: &mut sqlx::PgConnection = &mut connection;
        let held = sqlx::Executor::fetch_one(executor, hold_desired.as_str())
            .await
            .and_then(|row| sqlx::Row::try_get::<i64, _>(&row, 0));
        let high = match held {
            Ok(high) => high,
            Err(e) => {
                // The lock may be held: the connection is closed, not pooled.
                drop(connection.detach());
                return Err(e).context("holding desired changes");
            }
        };
        let hold = DesiredHold {
            connection: Some(connection),
        };
        if high > self.seen.load(Ordering::Acquire) {
            hold.release().await?;
            return Ok(None);
        }
        Ok(Some(hold))
    }

    /// Catches the cache up ([`Self::follow`]) only when the change log is
    /// ahead of it ([`Self::overtaken`]); true when it was.
    pub async fn follow_if_overtaken(&self) -> Result<bool, StoreError> {
        if !self.overtaken().await? {
            return Ok(false);
        }
        self.follow().await?;
        Ok(true)
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
        let high: i64 = sqlx::query_scalar("SELECT idem_begin_device_write($1)")
            .bind(DEVICE_WRITES_LOCK)
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
            version: high.max(seen) + 1,
            writer: self.id,
            _turn: turn,
            tx,
            changes: Vec::new(),
        })
    }

    /// Replaces the cache entries of the devices other writers changed in
    /// versions `(seen, high]` with their rows, and drops those that are
    /// gone. Every device when one of those changes said so (a new
    /// declaration of owned fields), or when the log no longer reaches back
    /// to `seen` (pruned while this process did not look).
    async fn catch_up(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        seen: i64,
        high: i64,
    ) -> Result<Followed, StoreError> {
        let mut changed = changed_by_others(tx, seen, high, self.id).await?;
        let mut changes = Vec::new();
        let mut followed = Followed::default();
        if let Changed::Some {
            rows,
            engine,
            reports,
        } = &mut changed
        {
            // The engine's columns alone: no specs to read or parse.
            for (id, change) in super::device_rows::engine_columns_of(tx, engine).await? {
                changes.push(FleetChange::Engine(id, change));
            }
            // The reported columns alone, of devices this cache holds and
            // that own no fields (their convergence digest is the stored
            // one); any other is read whole.
            let (known, unknown): (Vec<DeviceId>, Vec<DeviceId>) =
                std::mem::take(reports).into_iter().partition(|id| {
                    self.cache
                        .owned_if_known(id)
                        .is_some_and(|owned| owned.is_none_or(|owned| owned.is_empty()))
                });
            rows.extend(unknown);
            let (reported, unparsed) = super::device_rows::reported_columns_of(tx, &known).await?;
            rows.extend(unparsed);
            for (id, report) in reported {
                self.noticed(
                    &id,
                    report.reported.as_ref(),
                    report.online,
                    None,
                    &mut followed,
                );
                changes.push(FleetChange::FollowedReport(id, report));
            }
        }
        let (rows, owned_set) = match &changed {
            Changed::Some { rows, .. } if rows.is_empty() => {
                self.cache.apply(changes);
                return Ok(followed);
            }
            Changed::Some { rows, .. } => (super::device_rows::rows_of(tx, rows).await?, None),
            Changed::Everything => {
                let set = super::owned::load(&mut **tx)
                    .await?
                    .map(|d| d.set)
                    .unwrap_or_default();
                (super::device_rows::load_all_in(tx).await?, Some(set))
            }
        };
        let found: HashSet<&str> = rows.iter().map(|row| row.id.as_str()).collect();
        let gone: Vec<DeviceId> = match &changed {
            Changed::Some { rows: ids, .. } => ids
                .iter()
                .filter(|id| !found.contains(id.as_str()) && self.cache.contains(id))
                .cloned()
                .collect(),
            Changed::Everything => self
                .cache
                .ids()
                .into_iter()
                .filter(|id| !found.contains(id.as_str()))
                .collect(),
        };
        let set = owned_set.unwrap_or_else(|| (*self.cache.owned_set()).clone());
        let mut resolver = OwnedResolver::new(set.clone());
        let mut entries = super::device_rows::cache_entries(&rows, &mut resolver)?;
        let ids: Vec<DeviceId> = entries.iter().map(|(id, _)| id.clone()).collect();
        let exempt: HashSet<DeviceId> = super::exemptions::exempt_devices(&mut **tx, Some(&ids))
            .await?
            .into_iter()
            .collect();
        changes.reserve(entries.len() + gone.len() + 1);
        if matches!(changed, Changed::Everything) {
            changes.push(FleetChange::OwnedSet(Arc::new(set)));
        }
        for id in gone {
            followed.removed.push(id.clone());
            changes.push(FleetChange::Removed(id));
        }
        for (id, entry) in &mut entries {
            entry.exempt = exempt.contains(id);
            let exempt = Some(entry.exempt);
            self.noticed(
                id,
                entry.reported.as_ref(),
                entry.online,
                exempt,
                &mut followed,
            );
        }
        changes.extend(
            entries
                .into_iter()
                .map(|(id, entry)| FleetChange::Followed(id, entry)),
        );
        self.cache.apply(changes);
        Ok(followed)
    }

    /// Notes for the engine what a followed row tells that the cache did
    /// not hold: a newer report, a changed connection state, an exemption
    /// started or ended (`exempt`, when the row was read whole).
    fn noticed(
        &self,
        id: &DeviceId,
        reported: Option<&ReportedState>,
        online: Option<bool>,
        exempt: Option<bool>,
        followed: &mut Followed,
    ) {
        let before = self.cache.get(id);
        if let (Some(was), Some(now)) = (before.as_ref().map(|b| b.exempt), exempt) {
            if was && !now {
                followed.exemptions_ended.push(id.clone());
            } else if now && !was {
                followed.exemptions_started.push(id.clone());
            }
        }
        let seq_before = before
            .as_ref()
            .and_then(|b| b.reported.as_ref().map(|r| r.seq));
        if let Some(reported) = reported {
            if seq_before != Some(reported.seq) {
                followed.reported.push(id.clone());
            }
        }
        if let Some(online) = online {
            if before.as_ref().and_then(|b| b.online) != Some(online) {
                followed.online.push((id.clone(), online));
            }
        }
    }
}

/// What other writers changed since a version.
enum Changed {
    /// These devices (each once): `rows` whose rows may have changed
    /// anywhere, `engine` whose engine columns alone did, `reports` whose
    /// reported columns and connection state alone did.
    Some {
        rows: Vec<DeviceId>,
        engine: Vec<DeviceId>,
        reports: Vec<DeviceId>,
    },
    /// Every device.
    Everything,
}

/// The devices other writers than `me` changed in versions `(after, upto]`.
async fn changed_by_others(
    tx: &mut Transaction<'static, Postgres>,
    after: i64,
    upto: i64,
    me: Uuid,
) -> Result<Changed, StoreError> {
    let oldest: Option<i64> = sqlx::query_scalar("SELECT min(version) FROM device_changes")
        .fetch_one(&mut **tx)
        .await
        .context("reading the device change log")?;
    if oldest.is_some_and(|oldest| oldest > after + 1) {
        return Ok(Changed::Everything);
    }
    let logged: Vec<(Option<Vec<String>>, bool, bool)> = sqlx::query_as(
        "SELECT ids, engine_only, reports_only FROM device_changes \
         WHERE version > $1 AND version <= $2 AND writer <> $3 ORDER BY version",
    )
    .bind(after)
    .bind(upto)
    .bind(me)
    .fetch_all(&mut **tx)
    .await
    .context("reading the device change log")?;
    // Each id once per class: in `rows` alone if any entry may have changed
    // more than the engine's columns or the reported ones (a device whose
    // engine columns and reported columns both changed is read as both:
    // they are disjoint).
    let mut whole = HashSet::new();
    let mut engine = HashSet::new();
    let mut reports = HashSet::new();
    for (entry, engine_only, reports_only) in logged {
        let Some(entry) = entry else {
            return Ok(Changed::Everything);
        };
        let class = if engine_only {
            &mut engine
        } else if reports_only {
            &mut reports
        } else {
            &mut whole
        };
        class.extend(entry);
    }
    engine.retain(|id| !whole.contains(id));
    reports.retain(|id| !whole.contains(id));
    let context = "reading the device change log";
    let ids =
        |set: HashSet<String>| super::device_ids(&set.into_iter().collect::<Vec<_>>(), context);
    Ok(Changed::Some {
        rows: ids(whole)?,
        engine: ids(engine)?,
        reports: ids(reports)?,
    })
}

/// Keeps the device change log to what changed within `keep`: an instance
/// that looks less often reloads every device instead.
pub async fn prune_changes(pool: &PgPool, keep: std::time::Duration) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM device_changes WHERE at < now() - make_interval(secs => $1)")
        .bind(keep.as_secs_f64())
        .execute(pool)
        .await
        .context("pruning the device change log")?;
    Ok(())
}

/// The last device change version: read before loading the cache, it is
/// where the cache's following of other writers starts.
pub async fn versions_high(pool: &PgPool) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM device_changes")
        .fetch_one(pool)
        .await
        .context("reading the last device change version")
}

/// One device-writing transaction: the only handle through which device
/// rows change, collecting the cache changes that mirror them.
pub struct DeviceTx<'w> {
    cache: &'w FleetCache,
    seen: &'w AtomicI64,
    /// The version this transaction's entry in the change log gets.
    version: i64,
    writer: Uuid,
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
            version,
            writer,
            _turn,
            mut tx,
            changes,
        } = self;
        if changes.is_empty() {
            tx.commit().await.context(what)?;
            return Ok(());
        }
        // One entry in the change log, and a wake-up for the other
        // instances (its payload names this writer, which skips its own).
        let ids: Option<Vec<&str>> = changes
            .iter()
            .map(|change| change.device().map(DeviceId::as_str))
            .collect();
        let engine_only = changes
            .iter()
            .all(|change| matches!(change, FleetChange::Engine(..)));
        let reports_only = changes.iter().all(|change| {
            matches!(
                change,
                FleetChange::Reported { .. } | FleetChange::Online(..)
            )
        });
        if !engine_only && !reports_only {
            // Waits for a batch of publishes under way (`DesiredHold`).
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(DESIRED_CHANGES_LOCK)
                .execute(&mut *tx)
                .await
                .context(what)?;
        }
        sqlx::query(
            "WITH logged AS (INSERT INTO device_changes \
                                 (version, writer, ids, engine_only, reports_only) \
                             VALUES ($1, $2, $3, $4, $5)) \
             SELECT pg_notify('idem_devices', $2::text)",
        )
        .bind(version)
        .bind(writer)
        .bind(ids)
        .bind(engine_only)
        .bind(reports_only)
        .execute(&mut *tx)
        .await
        .context(what)?;
        tx.commit().await.context(what)?;
        // The cache has the changes before `seen` says so: a hold that
        // finds the version seen finds its changes in the cache.
        cache.apply(changes);
        seen.store(version, Ordering::Release);
        Ok(())
    }
}
