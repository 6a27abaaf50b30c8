//! Approval policies: the `approval_policies` rows, which policy, if any,
//! covers one of a change's devices (its labels contain the policy's
//! selector, or it was deleted while the policy covered it), read in the
//! caller's transaction, and the departures that keep a deleted device
//! covered when it is registered again.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgExecutor, Postgres, Transaction};
use uuid::Uuid;

use idem_protocol::DeviceId;

use super::{Context, StoreError};

/// A policy to insert.
#[derive(Debug, Clone, Copy)]
pub struct NewApprovalPolicy<'a> {
    pub id: Uuid,
    /// A label object: devices whose labels contain it.
    pub selector: &'a Value,
    pub reason: &'a str,
    pub author: &'a str,
}

/// A policy as stored, with how many registered devices it covers now.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ApprovalPolicyRow {
    pub id: Uuid,
    pub selector: Value,
    pub reason: String,
    pub author: String,
    pub created_at: DateTime<Utc>,
    pub devices: i64,
}

/// Whether policy `p` covers device `d`: its labels contain the selector,
/// or it was deleted while `p` covered it (and registered again since).
const COVERS: &str = "(d.labels @> p.selector OR EXISTS (SELECT 1 FROM covered_departures x \
     WHERE x.device_id = d.id AND x.policy_id = p.id))";

const ROW_COLUMNS: &str = "p.id, p.selector, p.reason, p.author, p.created_at, \
     (SELECT count(*) FROM devices d WHERE d.labels @> p.selector OR EXISTS \
         (SELECT 1 FROM covered_departures x WHERE x.device_id = d.id AND x.policy_id = p.id)) \
     AS devices";

/// SQL true when some policy covers device `d` (see [`COVERS`]); for
/// queries of other tables over `devices d`.
pub(crate) const POLICY_COVERS_D: &str = "(EXISTS (SELECT 1 FROM approval_policies p \
     WHERE d.labels @> p.selector) OR EXISTS (SELECT 1 FROM covered_departures x \
     WHERE x.device_id = d.id AND x.policy_id IS NOT NULL))";

/// What [`create`] did.
#[derive(Debug)]
pub enum Created {
    Created(ApprovalPolicyRow),
    /// `max` policies exist already (this many): nothing was created.
    Full(i64),
}

/// Creates the policy in `tx` unless `max` exist already (the table is
/// locked until `tx` ends, so concurrent creations cannot pass the limit).
pub async fn create(
    tx: &mut Transaction<'_, Postgres>,
    new: NewApprovalPolicy<'_>,
    max: i64,
) -> Result<Created, StoreError> {
    sqlx::query("LOCK TABLE approval_policies IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut **tx)
        .await
        .context("locking the approval policies")?;
    let existing: i64 = sqlx::query_scalar("SELECT count(*) FROM approval_policies")
        .fetch_one(&mut **tx)
        .await
        .context("counting approval policies")?;
    if existing >= max {
        return Ok(Created::Full(existing));
    }
    sqlx::query(
        "INSERT INTO approval_policies (id, selector, reason, author) VALUES ($1, $2, $3, $4)",
    )
    .bind(new.id)
    .bind(new.selector)
    .bind(new.reason)
    .bind(new.author)
    .execute(&mut **tx)
    .await
    .context("creating an approval policy")?;
    let row = get(&mut **tx, new.id).await?.ok_or(StoreError::Corrupt {
        context: "reading back an approval policy",
        detail: "the row inserted is not there".to_owned(),
    })?;
    Ok(Created::Created(row))
}

pub async fn get(
    executor: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<ApprovalPolicyRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS} FROM approval_policies p WHERE p.id = $1"
    ))
    .bind(id)
    .fetch_optional(executor)
    .await
    .context("reading an approval policy")
}

/// Every policy, oldest first.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<ApprovalPolicyRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS} FROM approval_policies p ORDER BY p.created_at, p.id"
    ))
    .fetch_all(executor)
    .await
    .context("listing approval policies")
}

/// Deletes the policy; the row as it was, if there was one.
pub async fn delete(
    executor: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<ApprovalPolicyRow>, StoreError> {
    sqlx::query_as(
        "DELETE FROM approval_policies p WHERE p.id = $1 \
         RETURNING p.id, p.selector, p.reason, p.author, p.created_at, 0::bigint AS devices",
    )
    .bind(id)
    .fetch_optional(executor)
    .await
    .context("deleting an approval policy")
}

/// The first policy a change of labels takes a registered device out of:
/// `ids[i]` getting `labels[i]` (JSON text) while its stored labels contain
/// the policy's selector and the new ones do not. (Policy id, device id.)
pub async fn first_left(
    executor: impl PgExecutor<'_>,
    ids: &[DeviceId],
    labels: &[String],
) -> Result<Option<(Uuid, DeviceId)>, StoreError> {
    const CONTEXT: &str = "reading whether new labels take devices out of approval policies";
    let found: Option<(Uuid, String)> = sqlx::query_as(
        "SELECT p.id, d.id FROM UNNEST($1::text[], $2::text[]) AS r(id, labels) \
         JOIN devices d ON d.id = r.id \
         JOIN approval_policies p \
             ON d.labels @> p.selector AND NOT r.labels::jsonb @> p.selector \
         WHERE NOT EXISTS (SELECT 1 FROM covered_departures x \
             WHERE x.device_id = d.id AND x.policy_id = p.id) \
         ORDER BY p.created_at, p.id, d.id LIMIT 1",
    )
    .bind(super::raw_ids(ids))
    .bind(labels)
    .fetch_optional(executor)
    .await
    .context(CONTEXT)?;
    found
        .map(|(policy, id)| Ok((policy, super::device_id(&id, CONTEXT)?)))
        .transpose()
}

/// A policy with how many of a change's devices it covers.
#[derive(sqlx::FromRow)]
struct Covering {
    #[sqlx(flatten)]
    policy: ApprovalPolicyRow,
    covered: i64,
}

/// A policy that covers at least one of `devices`, and how many of them
/// it covers (the oldest such policy), if any does.
pub async fn covering(
    executor: impl PgExecutor<'_>,
    devices: &[DeviceId],
) -> Result<Option<(ApprovalPolicyRow, i64)>, StoreError> {
    let found: Option<Covering> = sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS}, c.covered FROM approval_policies p \
         JOIN LATERAL (SELECT count(*) AS covered FROM devices d \
             WHERE d.id = ANY($1) AND {COVERS}) c ON c.covered > 0 \
         ORDER BY p.created_at, p.id LIMIT 1"
    ))
    .bind(super::raw_ids(devices))
    .fetch_optional(executor)
    .await
    .context("reading the approval policies that cover a change")?;
    Ok(found.map(|c| (c.policy, c.covered)))
}

/// A policy that covers at least one of the devices whose labels contain
/// `selector`, and how many of them it covers (the oldest such policy).
pub async fn covering_labels(
    executor: impl PgExecutor<'_>,
    selector: &Value,
) -> Result<Option<(ApprovalPolicyRow, i64)>, StoreError> {
    let found: Option<Covering> = sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS}, c.covered FROM approval_policies p \
         JOIN LATERAL (SELECT count(*) AS covered FROM devices d \
             WHERE d.labels @> $1 AND {COVERS}) c ON c.covered > 0 \
         ORDER BY p.created_at, p.id LIMIT 1"
    ))
    .bind(selector)
    .fetch_optional(executor)
    .await
    .context("reading the approval policies that cover a selector's devices")?;
    Ok(found.map(|c| (c.policy, c.covered)))
}

/// Records that `device`, about to be deleted by `by`, was covered: one
/// departure per policy covering it, and one without a policy when
/// `every_change` (the server requires approval of every change). Read
/// before the device row goes: its labels say which policies cover it.
pub async fn record_departure(
    executor: impl PgExecutor<'_>,
    device: &DeviceId,
    by: &str,
    every_change: bool,
) -> Result<u64, StoreError> {
    let done = sqlx::query(&format!(
        "INSERT INTO covered_departures (device_id, policy_id, departed_by) \
         SELECT d.id, p.id, $2 FROM devices d JOIN approval_policies p ON {COVERS} \
         WHERE d.id = $1 \
         UNION ALL SELECT $1, NULL, $2 WHERE $3 \
         ON CONFLICT DO NOTHING"
    ))
    .bind(device.as_str())
    .bind(by)
    .bind(every_change)
    .execute(executor)
    .await
    .context("recording the policies a deleted device leaves")?;
    Ok(done.rows_affected())
}

/// Among `devices`, those deleted once while covered (by a policy still in
/// force, or by `every_change` when that holds now): their first desired
/// spec since is a change, not a first one.
pub async fn departed_among(
    executor: impl PgExecutor<'_>,
    devices: &[DeviceId],
    every_change: bool,
) -> Result<Vec<DeviceId>, StoreError> {
    const CONTEXT: &str = "reading which devices left an approval policy by deletion";
    let departed: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT x.device_id FROM covered_departures x \
         WHERE x.device_id = ANY($1) AND (x.policy_id IS NOT NULL OR $2) ORDER BY 1",
    )
    .bind(super::raw_ids(devices))
    .bind(every_change)
    .fetch_all(executor)
    .await
    .context(CONTEXT)?;
    super::device_ids(&departed, CONTEXT)
}
