//! Drift exemptions: the `exemptions` rows, which devices they cover now
//! (one device, or the devices whose labels contain a selector's; a device
//! an approval policy covers only by an exemption another operator
//! approved), and the
//! fleet cache's `exempt` flags, kept equal to that by [`refresh`] in the
//! transaction of every change that can move them.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use idem_protocol::DeviceId;
use serde_json::Value;
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use super::cache::{FleetCache, FleetChange};
use super::{Context, DeviceTx, Scope, StoreError};

/// An exemption to insert.
#[derive(Debug, Clone, Copy)]
pub struct NewExemption<'a> {
    pub id: Uuid,
    pub device_id: Option<&'a str>,
    /// A label object: devices whose labels contain it.
    pub selector: Option<&'a Value>,
    pub reason: &'a str,
    pub author: &'a str,
    pub expires_at: DateTime<Utc>,
    /// Why it needs approval (made while some of its devices needed it): in
    /// force only once approved.
    pub needs_approval: Option<&'a str>,
}

/// An exemption as stored, with how many registered devices it covers now.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ExemptionRow {
    pub id: Uuid,
    pub device_id: Option<String>,
    pub selector: Option<Value>,
    pub reason: String,
    pub author: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub needs_approval: bool,
    pub approval_reason: Option<String>,
    pub approved_by: Option<String>,
    pub approved_at: Option<DateTime<Utc>>,
    pub devices: i64,
}

/// The columns of [`ExemptionRow`] for `exemptions e`, joined with
/// [`DEVICE_COUNTS`] as `c`. A device exemption covers its device (the
/// foreign key keeps it registered); a selector's devices are counted by
/// a join the labels index serves (a count per row with `OR` in it scanned
/// the whole device table once per exemption: 5.1 s for 1,000 exemptions
/// over 100,000 devices, 0.37 s this way).
const ROW_COLUMNS: &str = "e.id, e.device_id, e.selector, e.reason, e.author, e.created_at, \
     e.expires_at, e.needs_approval, e.approval_reason, e.approved_by, e.approved_at, CASE WHEN e.selector IS NULL THEN 1 ELSE COALESCE(c.n, 0) END AS devices";

/// How many devices each selector exemption matches, by exemption id (a
/// filter on `e.id` reaches inside it).
const DEVICE_COUNTS: &str = "LEFT JOIN (SELECT s.id, count(*) AS n FROM exemptions s \
     JOIN devices d ON d.labels @> s.selector WHERE s.selector IS NOT NULL GROUP BY s.id) c \
     ON c.id = e.id";

pub async fn create(write: &mut DeviceTx<'_>, new: NewExemption<'_>) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO exemptions (id, device_id, selector, reason, author, expires_at, \
         needs_approval, approval_reason) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(new.id)
    .bind(new.device_id)
    .bind(new.selector)
    .bind(new.reason)
    .bind(new.author)
    .bind(new.expires_at)
    .bind(new.needs_approval.is_some())
    .bind(new.needs_approval)
    .execute(&mut **write.tx())
    .await
    .context("creating an exemption")?;
    Ok(())
}

/// What [`approve`] found.
#[derive(Debug)]
pub enum Approval {
    Approved(ExemptionRow),
    /// No such exemption is in force (or it expired).
    Unknown,
    /// `by` made it: its author cannot approve it.
    OwnAuthor,
    /// Approved already, by this token at this time.
    Already(String, DateTime<Utc>),
}

/// Records `by`'s approval of an exemption not yet expired (the row is
/// locked until `write` ends, so two approvals cannot both pass).
pub async fn approve(write: &mut DeviceTx<'_>, id: Uuid, by: &str) -> Result<Approval, StoreError> {
    let found: Option<(String, Option<String>, Option<DateTime<Utc>>)> = sqlx::query_as(
        "SELECT author, approved_by, approved_at FROM exemptions \
         WHERE id = $1 AND expires_at > now() FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut **write.tx())
    .await
    .context("reading an exemption to approve")?;
    match found {
        None => return Ok(Approval::Unknown),
        Some((_, Some(by), Some(at))) => return Ok(Approval::Already(by, at)),
        Some((author, _, _)) if author == by => return Ok(Approval::OwnAuthor),
        Some(_) => {}
    }
    sqlx::query("UPDATE exemptions SET approved_by = $2, approved_at = now() WHERE id = $1")
        .bind(id)
        .bind(by)
        .execute(&mut **write.tx())
        .await
        .context("approving an exemption")?;
    Ok(get(&mut **write.tx(), id)
        .await?
        .map_or(Approval::Unknown, Approval::Approved))
}

/// How many exemptions have not expired.
pub async fn count_active(executor: impl PgExecutor<'_>) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT count(*) FROM exemptions WHERE expires_at > now()")
        .fetch_one(executor)
        .await
        .context("counting exemptions")
}

/// Exemptions in force made by `author`.
pub async fn count_active_by(
    executor: impl PgExecutor<'_>,
    author: &str,
) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT count(*) FROM exemptions WHERE expires_at > now() AND author = $1")
        .bind(author)
        .fetch_one(executor)
        .await
        .context("counting an author's exemptions")
}

/// Every exemption that has not expired, soonest to expire first.
pub async fn list(pool: &PgPool) -> Result<Vec<ExemptionRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS} FROM exemptions e {DEVICE_COUNTS} WHERE e.expires_at > now() \
         ORDER BY e.expires_at, e.id"
    ))
    .fetch_all(pool)
    .await
    .context("listing exemptions")
}

/// One exemption by id, expired or not (`None`: no such one).
pub async fn get(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<ExemptionRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS} FROM exemptions e {DEVICE_COUNTS} WHERE e.id = $1"
    ))
    .bind(id)
    .fetch_optional(db)
    .await
    .context("reading an exemption")
}

/// Deletes one exemption and returns it as it was (`None`: no such one).
pub async fn delete(
    write: &mut DeviceTx<'_>,
    id: Uuid,
) -> Result<Option<ExemptionRow>, StoreError> {
    let row: Option<ExemptionRow> = sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS} FROM exemptions e {DEVICE_COUNTS} WHERE e.id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut **write.tx())
    .await
    .context("reading an exemption")?;
    if row.is_some() {
        sqlx::query("DELETE FROM exemptions WHERE id = $1")
            .bind(id)
            .execute(&mut **write.tx())
            .await
            .context("deleting an exemption")?;
    }
    Ok(row)
}

/// Deletes every expired exemption; returns how many.
pub async fn delete_expired(write: &mut DeviceTx<'_>) -> Result<u64, StoreError> {
    let done = sqlx::query("DELETE FROM exemptions WHERE expires_at <= now()")
        .execute(&mut **write.tx())
        .await
        .context("deleting expired exemptions")?;
    Ok(done.rows_affected())
}

/// Whether any exemption has expired and is still stored.
pub async fn any_expired(pool: &PgPool) -> Result<bool, StoreError> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM exemptions WHERE expires_at <= now())")
        .fetch_one(pool)
        .await
        .context("looking for expired exemptions")
}

/// The devices an exemption covers now, among `among` (every device when
/// `None`).
pub async fn exempt_devices(
    executor: impl PgExecutor<'_>,
    among: Option<&[DeviceId]>,
) -> Result<Vec<DeviceId>, StoreError> {
    const CONTEXT: &str = "reading which devices are exempt";
    let exempt: Vec<String> = sqlx::query_scalar(
        // Driven from the exemptions, the selectors' devices through the
        // labels index: checking every device against every exemption
        // (`EXISTS … OR …`) took 3.96 s for 1,000 exemptions over 100,000
        // devices, holding the device writer; this takes 0.38 s.
        // An exemption no second operator approved exempts no device a
        // policy covers: waiting for approval, it exempts none.
        &format!(
            "SELECT d.id FROM exemptions e JOIN devices d ON d.id = e.device_id \
             WHERE e.device_id IS NOT NULL \
             AND e.expires_at > now() AND ($1::text[] IS NULL OR e.device_id = ANY($1)) \
             AND (e.approved_by IS NOT NULL OR (NOT e.needs_approval AND NOT {covers})) \
             UNION \
             SELECT d.id FROM exemptions e JOIN devices d ON d.labels @> e.selector \
             WHERE e.selector IS NOT NULL AND e.expires_at > now() \
             AND ($1::text[] IS NULL OR d.id = ANY($1)) \
             AND (e.approved_by IS NOT NULL OR (NOT e.needs_approval AND NOT {covers}))",
            covers = super::approvals::POLICY_COVERS_D
        ),
    )
    .bind(among.map(super::raw_ids))
    .fetch_all(executor)
    .await
    .context(CONTEXT)?;
    super::device_ids(&exempt, CONTEXT)
}

/// Which devices a [`refresh`] exempted and which it released.
#[derive(Debug, Default)]
pub struct Moved {
    pub started: Vec<DeviceId>,
    pub ended: Vec<DeviceId>,
}

/// Sets the cache's `exempt` flag of every device in `scope` to what the
/// exemptions cover now (mirrored when `write` commits) and returns the
/// devices whose exemption starts or ends with it.
pub async fn refresh(
    write: &mut DeviceTx<'_>,
    fleet: &FleetCache,
    scope: Scope<'_>,
) -> Result<Moved, StoreError> {
    let among = scope.ids();
    let now: HashSet<DeviceId> = exempt_devices(&mut **write.tx(), among)
        .await?
        .into_iter()
        .collect();
    let flagged: HashSet<DeviceId> = match scope {
        Scope::All => fleet.ids_exempt().into_iter().collect(),
        Scope::Devices(ids) => ids
            .iter()
            .filter(|id| fleet.get(id).is_some_and(|e| e.exempt))
            .cloned()
            .collect(),
    };
    let mut changes = Vec::new();
    let mut started = Vec::new();
    for id in now.iter().cloned() {
        if !flagged.contains(&id) {
            changes.push(FleetChange::Exempt(id.clone(), true));
            started.push(id);
        }
    }
    let ended: Vec<DeviceId> = flagged.into_iter().filter(|id| !now.contains(id)).collect();
    changes.extend(
        ended
            .iter()
            .map(|id| FleetChange::Exempt(id.clone(), false)),
    );
    write.mirror(changes);
    Ok(Moved { started, ended })
}
