//! Device-owned fields: the one stored declaration (`owned_fields`), and
//! the fleet cache's per-device owned paths and convergence digests, kept
//! equal to it by [`refresh`] in the transaction of every change that can
//! move them (a new declaration, a registration or relabelling).

use chrono::{DateTime, Utc};
use idem_protocol::api::OwnedFieldsDeclaration;
use idem_protocol::{DeviceId, SpecDigest};
use serde_json::Value;
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use super::cache::FleetChange;
use super::{Context, DeviceTx, Scope, StoreError};
use crate::reconcile::owned::{convergence_digest, OwnedFieldSet, OwnedResolver};

/// The declaration as stored, with who made it and when.
#[derive(Debug, Clone)]
pub struct StoredDeclaration {
    pub declaration: OwnedFieldsDeclaration,
    pub set: OwnedFieldSet,
    pub updated_by: String,
    pub updated_at: DateTime<Utc>,
}

/// The stored declaration (`None`: none was ever made). One that no longer
/// reads as a declaration (a hand edit) is corrupt data, named as such: the
/// server does not guess which fields devices own.
pub async fn load(db: impl PgExecutor<'_>) -> Result<Option<StoredDeclaration>, StoreError> {
    let row: Option<(Value, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT declaration, updated_by, updated_at FROM owned_fields WHERE singleton",
    )
    .fetch_optional(db)
    .await
    .context("reading the owned fields")?;
    let Some((raw, updated_by, updated_at)) = row else {
        return Ok(None);
    };
    let corrupt = |detail: String| StoreError::Corrupt {
        context: "reading the owned fields",
        detail,
    };
    let declaration: OwnedFieldsDeclaration =
        serde_json::from_value(raw).map_err(|e| corrupt(e.to_string()))?;
    let set = OwnedFieldSet::from_declaration(&declaration).map_err(|e| corrupt(e.to_string()))?;
    Ok(Some(StoredDeclaration {
        declaration,
        set,
        updated_by,
        updated_at,
    }))
}

/// The declared set, empty when none was made.
pub async fn declared_set(pool: &PgPool) -> Result<OwnedFieldSet, StoreError> {
    Ok(load(pool).await?.map(|d| d.set).unwrap_or_default())
}

/// Replaces the declaration; returns when, as stored.
pub async fn save(
    write: &mut DeviceTx<'_>,
    declaration: &OwnedFieldsDeclaration,
    updated_by: &str,
) -> Result<DateTime<Utc>, StoreError> {
    let raw = serde_json::to_value(declaration).map_err(|e| StoreError::Corrupt {
        context: "writing the owned fields",
        detail: e.to_string(),
    })?;
    sqlx::query_scalar(
        "INSERT INTO owned_fields (singleton, declaration, updated_by, updated_at) \
         VALUES (true, $1, $2, now()) \
         ON CONFLICT (singleton) DO UPDATE SET declaration = $1, updated_by = $2, updated_at = now() \
         RETURNING updated_at",
    )
    .bind(raw)
    .bind(updated_by)
    .fetch_one(&mut **write.tx())
    .await
    .context("writing the owned fields")
}

/// What [`refresh`] changed.
#[derive(Debug, Default)]
pub struct Refreshed {
    /// Devices whose owned paths changed.
    pub devices: Vec<DeviceId>,
    /// Those of them whose desired spec, as published, changed with it: a
    /// retained desired message they have is to be published again.
    pub republish: Vec<DeviceId>,
}

#[derive(sqlx::FromRow)]
struct OwnedRow {
    id: String,
    labels: Value,
    reported_spec: Option<Value>,
    reported_digest: Option<String>,
}

/// Sets the cache's owned paths of every device in `scope` to what `set`
/// gives its labels, with the convergence digests that follow (mirrored
/// when `write` commits). Reads nothing when neither `set` nor any device
/// in `scope` owns a path.
pub async fn refresh(
    write: &mut DeviceTx<'_>,
    set: &OwnedFieldSet,
    scope: Scope<'_>,
) -> Result<Refreshed, StoreError> {
    let among = scope.ids();
    if set.is_empty() {
        let owning = match among {
            None => write.cache().any_owned(),
            Some(ids) => ids.iter().any(|id| write.cache().owned(id).is_some()),
        };
        if !owning {
            return Ok(Refreshed::default());
        }
    }
    let rows: Vec<OwnedRow> = sqlx::query_as(
        "SELECT id, labels, reported_spec, reported_digest FROM devices \
         WHERE $1::text[] IS NULL OR id = ANY($1)",
    )
    .bind(among.map(super::raw_ids))
    .fetch_all(&mut **write.tx())
    .await
    .context("reading the devices whose owned fields to resolve")?;
    let mut resolver = OwnedResolver::new(set.clone());
    let mut refreshed = Refreshed::default();
    let mut stale = Vec::new();
    let mut changes = Vec::new();
    for row in rows {
        let id = super::device_id(&row.id, "resolving owned fields")?;
        let owned = resolver.for_labels(&row.labels);
        // A device registered in this transaction is not in the cache yet:
        // its entry is mirrored, empty, before this change.
        let entry = write.cache().get(&id).unwrap_or_default();
        if entry.owned.as_deref() == owned.as_deref() {
            continue;
        }
        let reported_digest = match (&row.reported_spec, &row.reported_digest) {
            (Some(spec), Some(stored)) => {
                let full = SpecDigest::parse(stored).unwrap_or_else(|_| SpecDigest::of(spec));
                Some(convergence_digest(spec, full, owned.as_deref()))
            }
            _ => None,
        };
        // Judged on the desired spec alone, not on whether the cache knows
        // of a retained message: one the engine published and has not
        // written yet is republished all the same (`OwnedChanged`).
        let retained_stale = entry.desired.as_ref().is_some_and(|desired| {
            desired.published(entry.owned.as_deref()) != desired.published(owned.as_deref())
        });
        if retained_stale {
            stale.push(row.id.clone());
            refreshed.republish.push(id.clone());
        }
        refreshed.devices.push(id.clone());
        changes.push(FleetChange::Owned {
            id,
            owned,
            reported_digest,
            retained_stale,
        });
    }
    if !stale.is_empty() {
        sqlx::query(
            "UPDATE devices SET retained_generation = 0 \
             WHERE id = ANY($1) AND retained_generation IS NOT NULL",
        )
        .bind(&stale)
        .execute(&mut **write.tx())
        .await
        .context("marking retained desired messages to publish again")?;
    }
    write.mirror(changes);
    Ok(refreshed)
}

/// A declaration waiting for another operator's approval, as stored.
#[derive(Debug, Clone)]
pub struct StoredProposal {
    pub id: Uuid,
    pub declaration: OwnedFieldsDeclaration,
    pub author: String,
    /// The `updated_at` of the declaration in force when it was proposed.
    pub based_on: Option<DateTime<Utc>>,
    pub reason: String,
    pub devices_changed: i64,
    pub created_at: DateTime<Utc>,
}

type ProposalRow = (
    Uuid,
    Value,
    String,
    Option<DateTime<Utc>>,
    String,
    i64,
    DateTime<Utc>,
);

const PROPOSAL_COLUMNS: &str =
    "id, declaration, author, based_on, reason, devices_changed, created_at";

fn proposal(row: ProposalRow) -> Result<StoredProposal, StoreError> {
    let (id, raw, author, based_on, reason, devices_changed, created_at) = row;
    let declaration = serde_json::from_value(raw).map_err(|e| StoreError::Corrupt {
        context: "reading a proposed declaration of owned fields",
        detail: e.to_string(),
    })?;
    Ok(StoredProposal {
        id,
        declaration,
        author,
        based_on,
        reason,
        devices_changed,
        created_at,
    })
}

/// What [`propose`] did.
#[derive(Debug)]
pub enum Proposed {
    Proposed(StoredProposal),
    /// `max` proposals of other authors wait already: nothing was stored.
    Full,
}

/// Stores `author`'s proposal, replacing the one they had, unless `max`
/// proposals wait already (the table is locked until `tx` ends, so
/// concurrent proposals cannot pass the limit).
pub async fn propose(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    new: &StoredProposal,
    max: i64,
) -> Result<Proposed, StoreError> {
    sqlx::query("LOCK TABLE owned_fields_proposals IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut **tx)
        .await
        .context("locking the owned-fields proposals")?;
    let others: i64 =
        sqlx::query_scalar("SELECT count(*) FROM owned_fields_proposals WHERE author <> $1")
            .bind(&new.author)
            .fetch_one(&mut **tx)
            .await
            .context("counting owned-fields proposals")?;
    if others >= max {
        return Ok(Proposed::Full);
    }
    let raw = serde_json::to_value(&new.declaration).map_err(|e| StoreError::Corrupt {
        context: "writing a proposed declaration of owned fields",
        detail: e.to_string(),
    })?;
    let row: ProposalRow = sqlx::query_as(&format!(
        "INSERT INTO owned_fields_proposals \
         (id, declaration, author, based_on, reason, devices_changed) \
         VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (author) DO UPDATE SET id = $1, declaration = $2, based_on = $4, \
         reason = $5, devices_changed = $6, created_at = now() \
         RETURNING {PROPOSAL_COLUMNS}"
    ))
    .bind(new.id)
    .bind(raw)
    .bind(&new.author)
    .bind(new.based_on)
    .bind(&new.reason)
    .bind(new.devices_changed)
    .fetch_one(&mut **tx)
    .await
    .context("storing a proposed declaration of owned fields")?;
    Ok(Proposed::Proposed(proposal(row)?))
}

/// Every proposal waiting, oldest first.
pub async fn proposals(db: impl PgExecutor<'_>) -> Result<Vec<StoredProposal>, StoreError> {
    let rows: Vec<ProposalRow> = sqlx::query_as(&format!(
        "SELECT {PROPOSAL_COLUMNS} FROM owned_fields_proposals ORDER BY created_at, id"
    ))
    .fetch_all(db)
    .await
    .context("listing owned-fields proposals")?;
    rows.into_iter().map(proposal).collect()
}

/// The proposal `id`, locked until `write` ends (`None`: no such one).
pub async fn proposal_for_approval(
    write: &mut DeviceTx<'_>,
    id: Uuid,
) -> Result<Option<StoredProposal>, StoreError> {
    let row: Option<ProposalRow> = sqlx::query_as(&format!(
        "SELECT {PROPOSAL_COLUMNS} FROM owned_fields_proposals WHERE id = $1 FOR UPDATE"
    ))
    .bind(id)
    .fetch_optional(&mut **write.tx())
    .await
    .context("reading an owned-fields proposal")?;
    row.map(proposal).transpose()
}

/// Deletes proposal `id` (approved, or overtaken).
pub async fn delete_proposal(write: &mut DeviceTx<'_>, id: Uuid) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM owned_fields_proposals WHERE id = $1")
        .bind(id)
        .execute(&mut **write.tx())
        .await
        .context("deleting an owned-fields proposal")?;
    Ok(())
}
