//! The `instances` table: which server process holds each instance name,
//! claimed at start-up, kept alive by a heartbeat, released at a graceful
//! stop. SQL only; the start-up rules are in `app::instance`.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::{Context, StoreError};

/// The process claiming or holding a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimant {
    pub holder: Uuid,
    pub host: String,
    pub pid: u32,
    /// A heartbeat older than this makes the claim stale.
    pub lease: Duration,
}

/// The current holder of a name, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    pub holder: Uuid,
    pub host: String,
    pub pid: u32,
    /// Seconds since its last heartbeat, by the database's clock.
    pub heartbeat_age_secs: f64,
    /// Seconds since it started.
    pub age_secs: f64,
    pub lease: Duration,
    /// The instance draining this one's MQTT session, while one does.
    pub drained_by: Option<String>,
}

/// Every instance row, for `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceRow {
    pub name: String,
    pub holder: Holder,
}

fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// Claims `name` for `claimant` when nobody holds it, when its holder's
/// heartbeat is older than that holder's lease, or when `replacing` names the
/// holder (one the caller knows to be dead). `true` when the claim is ours.
pub async fn claim(
    pool: &PgPool,
    name: &str,
    claimant: &Claimant,
    replacing: Option<Uuid>,
) -> Result<bool, StoreError> {
    let claimed: Option<Uuid> = sqlx::query_scalar(
        "INSERT INTO instances (name, holder, host, pid, lease_ms) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, host = EXCLUDED.host, \
             pid = EXCLUDED.pid, lease_ms = EXCLUDED.lease_ms, started_at = now(), heartbeat_at = now(), \
             drained_by = NULL \
         WHERE instances.heartbeat_at < now() - make_interval(secs => instances.lease_ms / 1000.0) \
            OR instances.holder = $6 \
         RETURNING holder",
    )
    .bind(name)
    .bind(claimant.holder)
    .bind(&claimant.host)
    .bind(i32::try_from(claimant.pid).unwrap_or(i32::MAX))
    .bind(lease_ms(claimant.lease))
    .bind(replacing)
    .fetch_optional(pool)
    .await
    .context("claiming the instance name")?;
    Ok(claimed == Some(claimant.holder))
}

/// Records whether `holder`, holding `name`, requires approval of every
/// desired change; returns a live instance other than `name` whose setting
/// differs, if there is one (its name and setting).
pub async fn record_require_approval(
    pool: &PgPool,
    name: &str,
    holder: Uuid,
    require_approval: bool,
) -> Result<Option<(String, bool)>, StoreError> {
    sqlx::query("UPDATE instances SET require_approval = $3 WHERE name = $1 AND holder = $2")
        .bind(name)
        .bind(holder)
        .bind(require_approval)
        .execute(pool)
        .await
        .context("recording the instance's approval setting")?;
    sqlx::query_as(
        "SELECT name, require_approval FROM instances \
         WHERE name <> $1 AND require_approval <> $2 \
           AND heartbeat_at >= now() - make_interval(secs => lease_ms / 1000.0) \
         ORDER BY name LIMIT 1",
    )
    .bind(name)
    .bind(require_approval)
    .fetch_optional(pool)
    .await
    .context("reading the other instances' approval settings")
}

/// The current holder of `name`, if any.
pub async fn holder(pool: &PgPool, name: &str) -> Result<Option<Holder>, StoreError> {
    let row: Option<HolderColumns> = sqlx::query_as(
        "SELECT holder, host, pid, \
                EXTRACT(EPOCH FROM now() - heartbeat_at)::float8, \
                EXTRACT(EPOCH FROM now() - started_at)::float8, lease_ms, drained_by \
         FROM instances WHERE name = $1",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
    .context("reading the instance name's holder")?;
    Ok(row.map(holder_from))
}

type HolderColumns = (Uuid, String, i32, f64, f64, i64, Option<String>);

fn holder_from(
    (holder, host, pid, heartbeat_age_secs, age_secs, lease_ms, drained_by): HolderColumns,
) -> Holder {
    Holder {
        holder,
        host,
        pid: u32::try_from(pid).unwrap_or(0),
        heartbeat_age_secs,
        age_secs,
        lease: Duration::from_millis(u64::try_from(lease_ms).unwrap_or(1)),
        drained_by,
    }
}

/// Every instance row, by name.
pub async fn all(pool: &PgPool) -> Result<Vec<InstanceRow>, StoreError> {
    let rows: Vec<NamedHolder> = sqlx::query_as(
        "SELECT name, holder, host, pid, \
                EXTRACT(EPOCH FROM now() - heartbeat_at)::float8 AS heartbeat_age_secs, \
                EXTRACT(EPOCH FROM now() - started_at)::float8 AS age_secs, lease_ms, drained_by \
         FROM instances ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .context("listing the instances")?;
    Ok(rows
        .into_iter()
        .map(|row| InstanceRow {
            name: row.name,
            holder: holder_from((
                row.holder,
                row.host,
                row.pid,
                row.heartbeat_age_secs,
                row.age_secs,
                row.lease_ms,
                row.drained_by,
            )),
        })
        .collect())
}

#[derive(sqlx::FromRow)]
struct NamedHolder {
    name: String,
    holder: Uuid,
    host: String,
    pid: i32,
    heartbeat_age_secs: f64,
    age_secs: f64,
    lease_ms: i64,
    drained_by: Option<String>,
}

/// Renews the heartbeat of `holder`'s claim. `false` when the claim is no
/// longer `holder`'s (another process took the name over).
pub async fn heartbeat(pool: &PgPool, name: &str, holder: Uuid) -> Result<bool, StoreError> {
    let done =
        sqlx::query("UPDATE instances SET heartbeat_at = now() WHERE name = $1 AND holder = $2")
            .bind(name)
            .bind(holder)
            .execute(pool)
            .await
            .context("renewing the instance heartbeat")?;
    Ok(done.rows_affected() == 1)
}

/// Gives the name up (a graceful stop), if `holder` still holds it.
pub async fn release(pool: &PgPool, name: &str, holder: Uuid) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM instances WHERE name = $1 AND holder = $2")
        .bind(name)
        .bind(holder)
        .execute(pool)
        .await
        .context("releasing the instance name")?;
    Ok(())
}

/// Ends `holder`'s claim at once without giving the name up (a graceful
/// stop of an instance sharing the fleet's subscriptions): the row goes
/// stale now, so a survivor drains the session it leaves on the broker.
pub async fn mark_stopped(pool: &PgPool, name: &str, holder: Uuid) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE instances \
         SET heartbeat_at = now() - make_interval(secs => lease_ms / 1000.0) - interval '1 second' \
         WHERE name = $1 AND holder = $2",
    )
    .bind(name)
    .bind(holder)
    .execute(pool)
    .await
    .context("marking the instance stopped")?;
    Ok(())
}

/// Takes the stale claim of one instance other than `drainer` (stopped, or
/// dead with no heartbeat for its lease) to drain its MQTT session: the row
/// becomes `claimant`'s, with `drained_by = drainer` and a fresh heartbeat,
/// so no other survivor takes it while the drain lasts less than that
/// instance's lease. The name taken, if any.
pub async fn take_stale_for_drain(
    pool: &PgPool,
    drainer: &str,
    claimant: &Claimant,
) -> Result<Option<String>, StoreError> {
    sqlx::query_scalar(
        "UPDATE instances SET holder = $2, host = $3, pid = $4, heartbeat_at = now(), drained_by = $1 \
         WHERE name = ( \
             SELECT name FROM instances \
             WHERE name <> $1 \
               AND heartbeat_at < now() - make_interval(secs => lease_ms / 1000.0) \
             ORDER BY heartbeat_at LIMIT 1 FOR UPDATE SKIP LOCKED) \
         RETURNING name",
    )
    .bind(drainer)
    .bind(claimant.holder)
    .bind(&claimant.host)
    .bind(i32::try_from(claimant.pid).unwrap_or(i32::MAX))
    .fetch_optional(pool)
    .await
    .context("taking a stale instance claim to drain its session")
}
