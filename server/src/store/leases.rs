//! The `leases` table: work exactly one instance does at a time, taken
//! when free or expired, renewed by its holder, and fenced by an epoch that
//! grows each time it changes hands; and a holder's [`LeaseDeadline`] on its
//! own monotonic clock. Holders are in `events::relay` and `engine::seat`.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::{Context, StoreError};

/// Who asks for a lease.
#[derive(Debug, Clone)]
pub struct LeaseHolder {
    /// The instance name (shown in `GET /v1/cluster`).
    pub instance: String,
    /// This holder's own id: one per process and lease.
    pub id: Uuid,
    /// The lease expires this long after its last renewal.
    pub ttl: Duration,
}

/// The time to live of a lease whose work must be taken over within
/// `bound` (`--instance-lease`) of its holder's death: three quarters of
/// it. A holder killed just before renewing leaves the lease to expire
/// that long after its last renewal; the last quarter is the successor's
/// (its tries every 250 ms, taking up the work and deciding on it).
pub fn time_to_live(bound: Duration) -> Duration {
    bound * 3 / 4
}

/// A lease held: the epoch every fenced write checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub epoch: i64,
}

/// Until when a lease held is surely still ours, on this process's
/// monotonic clock (which runs on while the process is paused): the time
/// its last successful take or renewal was asked for, plus its time to
/// live. The database's own expiry comes later than that, never earlier.
/// Side effects a write's fence cannot cover (publishing to the broker)
/// check it first.
#[derive(Debug, Clone)]
pub struct LeaseDeadline(std::sync::Arc<std::sync::Mutex<std::time::Instant>>);

impl LeaseDeadline {
    /// A deadline for a lease taken by a request asked at `asked`.
    pub fn new(asked: std::time::Instant, ttl: Duration) -> Self {
        Self(std::sync::Arc::new(std::sync::Mutex::new(asked + ttl)))
    }

    /// A renewal asked at `asked` succeeded.
    pub fn renewed(&self, asked: std::time::Instant, ttl: Duration) {
        let mut until = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *until = (*until).max(asked + ttl);
    }

    /// Whether the lease may have lapsed by now.
    pub fn lapsed(&self) -> bool {
        let until = *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::time::Instant::now() >= until
    }
}

/// What a write fenced by a lease checks in its own transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    pub lease: &'static str,
    pub holder_id: Uuid,
    pub epoch: i64,
}

/// Checks, in `tx`, that `fence`'s holder still holds its lease at its
/// epoch and within its time to live (by the database's clock now, not the
/// transaction's start), and share-locks the lease row until `tx` ends: a
/// takeover (which updates the row) waits for this transaction, so a write
/// that passed the check commits before any new holder's first one, and a
/// holder that lost the lease commits nothing.
pub async fn check_fence(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    fence: &Fence,
) -> Result<(), StoreError> {
    let held: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM leases WHERE name = $1 AND holder_id = $2 AND epoch = $3 \
           AND renewed_at >= clock_timestamp() - make_interval(secs => ttl_ms / 1000.0) \
         FOR SHARE",
    )
    .bind(fence.lease)
    .bind(fence.holder_id)
    .bind(fence.epoch)
    .fetch_optional(&mut **tx)
    .await
    .context("checking the lease of a fenced write")?;
    match held {
        Some(_) => Ok(()),
        None => Err(StoreError::LeaseLost {
            lease: fence.lease,
            epoch: fence.epoch,
        }),
    }
}

/// One lease as stored, for `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseRow {
    pub name: String,
    pub holder: String,
    pub epoch: i64,
    /// Seconds since its last renewal, by the database's clock (`None`:
    /// released).
    pub renewed_age_secs: Option<f64>,
    pub ttl: Duration,
}

/// Takes `name` for `holder` when it is free or expired, or renews it when
/// `holder` has it. A lease held under `holder`'s instance name by another
/// process is taken at once: instance names are claimed (`instances`), so
/// that process is gone (a restart after a crash). `None`: another
/// instance's lease is still running.
pub async fn acquire_or_renew(
    pool: &PgPool,
    name: &str,
    holder: &LeaseHolder,
) -> Result<Option<Held>, StoreError> {
    let ttl_ms = i64::try_from(holder.ttl.as_millis())
        .unwrap_or(i64::MAX)
        .max(1);
    let epoch: Option<i64> = sqlx::query_scalar(
        "INSERT INTO leases (name, holder, holder_id, epoch, renewed_at, ttl_ms) \
         VALUES ($1, $2, $3, 1, now(), $4) \
         ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, holder_id = EXCLUDED.holder_id, \
             epoch = CASE WHEN leases.holder_id = EXCLUDED.holder_id THEN leases.epoch \
                          ELSE leases.epoch + 1 END, \
             renewed_at = now(), ttl_ms = EXCLUDED.ttl_ms \
         WHERE leases.holder_id = EXCLUDED.holder_id OR leases.holder = EXCLUDED.holder \
            OR leases.renewed_at < now() - make_interval(secs => leases.ttl_ms / 1000.0) \
         RETURNING epoch",
    )
    .bind(name)
    .bind(&holder.instance)
    .bind(holder.id)
    .bind(ttl_ms)
    .fetch_optional(pool)
    .await
    .context("taking or renewing a lease")?;
    Ok(epoch.map(|epoch| Held { epoch }))
}

/// Lets `name` expire at once if `holder` still has it (a graceful stop):
/// the next holder need not wait out the lease. The epoch stays.
pub async fn release(pool: &PgPool, name: &str, holder: Uuid) -> Result<(), StoreError> {
    sqlx::query("UPDATE leases SET renewed_at = '-infinity' WHERE name = $1 AND holder_id = $2")
        .bind(name)
        .bind(holder)
        .execute(pool)
        .await
        .context("releasing a lease")?;
    Ok(())
}

/// Every lease, by name.
pub async fn all(pool: &PgPool) -> Result<Vec<LeaseRow>, StoreError> {
    // A released lease's `renewed_at` is `-infinity`, which PostgreSQL
    // before 17 refuses to subtract from.
    let rows: Vec<(String, String, i64, Option<f64>, i64)> = sqlx::query_as(
        "SELECT name, holder, epoch, \
                CASE WHEN isfinite(renewed_at) THEN EXTRACT(EPOCH FROM now() - renewed_at)::float8 END, \
                ttl_ms \
         FROM leases ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .context("listing the leases")?;
    Ok(rows
        .into_iter()
        .map(|(name, holder, epoch, renewed_age_secs, ttl_ms)| LeaseRow {
            name,
            holder,
            epoch,
            renewed_age_secs,
            ttl: Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(1)),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{time_to_live, LeaseDeadline};

    #[test]
    fn a_lease_lives_three_quarters_of_the_takeover_bound_leaving_the_successor_the_last_quarter() {
        assert_eq!(
            time_to_live(Duration::from_secs(10)),
            Duration::from_millis(7_500)
        );
        assert_eq!(
            time_to_live(Duration::from_secs(3)),
            Duration::from_millis(2_250)
        );
        assert_eq!(time_to_live(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_lease_deadline_lapses_a_time_to_live_after_it_was_asked_for_unless_renewed() {
        let ttl = Duration::from_secs(10);
        let now = Instant::now();
        assert!(!LeaseDeadline::new(now, ttl).lapsed());
        let deadline = LeaseDeadline::new(now, Duration::ZERO);
        assert!(deadline.lapsed(), "its time to live is over: lapsed");
        deadline.renewed(now, ttl);
        assert!(!deadline.lapsed(), "renewed: held again");
        deadline.renewed(now, Duration::ZERO);
        assert!(
            !deadline.lapsed(),
            "a renewal that ends sooner moves nothing back"
        );
    }
}
