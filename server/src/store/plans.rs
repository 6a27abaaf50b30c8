//! Plans as stored (`plans`), so that every instance reads the same book
//! and a restart keeps it: a plan's content written once, its slot and
//! approval changed under a row lock by the book's rules
//! (`reconcile::plan::book`), and a small cache of contents, which never
//! change once written.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use idem_protocol::api::TargetedRequest;
use idem_protocol::{DeviceStatus, SpecDigest};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::{device_id, generation, stored_generation, to_i64, to_u64, Context, StoreError};
use crate::reconcile::owned::{parse_path, OwnedFields};
use crate::reconcile::plan::book::{BookRefusal, KeptPlan, Slot};
use crate::reconcile::plan::{
    Basis, Plan, PlanApproval, PlanCounts, PlanSkip, PlannedDevice, ReportedBasis, Verdict,
};
use crate::reconcile::policy::Blocked;

/// The advisory lock key of a new plan's admission (any constant works;
/// this one spells "idem plan" in ASCII, shortened).
const PLAN_ADMISSION_LOCK: i64 = 0x6964_656d_706c_616e;

/// What a plan's row says, but its content.
const SLOT_COLUMNS: &str = "p.id, p.author, p.created_at, p.expires_at, p.state, p.claimed_at, \
     p.applied_run, p.approved_by, p.approved_at, r.id AS run";

#[derive(sqlx::FromRow)]
struct SlotRow {
    id: Uuid,
    author: String,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    state: String,
    claimed_at: Option<DateTime<Utc>>,
    applied_run: Option<Uuid>,
    approved_by: Option<String>,
    approved_at: Option<DateTime<Utc>>,
    /// The run that applied it, whatever `state` says: a call that died
    /// between starting the run and writing `applied` leaves it applying.
    run: Option<Uuid>,
}

impl SlotRow {
    fn kept(self) -> Result<KeptPlan, StoreError> {
        let slot = match (self.run.or(self.applied_run), self.state.as_str()) {
            (Some(run), _) => Slot::Applied(run),
            (None, "open") => Slot::Open,
            (None, "applying") => Slot::Applying {
                since: self.claimed_at.unwrap_or(self.created_at),
            },
            (None, other) => {
                return Err(StoreError::Corrupt {
                    context: "reading a plan",
                    detail: format!("plan {} is {other:?} without a run", self.id),
                })
            }
        };
        let approval = match (self.approved_by, self.approved_at) {
            (Some(by), Some(at)) => Some(PlanApproval { by, at }),
            (None, _) | (_, None) => None,
        };
        Ok(KeptPlan {
            id: self.id,
            author: self.author,
            created_at: self.created_at,
            expires_at: self.expires_at,
            slot,
            approval,
        })
    }
}

/// Keeps `plan` if `admit` (the book's rules, given every kept plan) lets
/// it, forgetting the plans it names; plans are admitted one at a time.
pub async fn keep(
    pool: &PgPool,
    plan: &Plan,
    admit: impl FnOnce(&[KeptPlan]) -> Result<Vec<Uuid>, BookRefusal>,
) -> Result<Result<(), BookRefusal>, StoreError> {
    let mut tx = pool.begin().await.context("starting to keep a plan")?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(PLAN_ADMISSION_LOCK)
        .execute(&mut *tx)
        .await
        .context("taking the plan admission lock")?;
    let rows: Vec<SlotRow> = sqlx::query_as(&format!(
        "SELECT {SLOT_COLUMNS} FROM plans p LEFT JOIN runs r ON r.plan_id = p.id"
    ))
    .fetch_all(&mut *tx)
    .await
    .context("reading the kept plans")?;
    let kept = rows
        .into_iter()
        .map(SlotRow::kept)
        .collect::<Result<Vec<_>, _>>()?;
    let forget = match admit(&kept) {
        Ok(forget) => forget,
        Err(refusal) => return Ok(Err(refusal)),
    };
    sqlx::query("DELETE FROM plans WHERE id = ANY($1)")
        .bind(&forget)
        .execute(&mut *tx)
        .await
        .context("forgetting plans")?;
    let targeting = serde_json::to_value(TargetedRequest::from(plan.targeting.clone()))
        .map_err(|e| corrupt("writing a plan's targeting", e))?;
    let devices: Vec<StoredDevice> = plan.devices.iter().map(StoredDevice::of).collect();
    sqlx::query(
        "INSERT INTO plans (id, author, created_at, expires_at, targeting, spec, digest, \
         force, counts, devices) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(plan.id)
    .bind(&plan.author)
    .bind(plan.created_at)
    .bind(plan.expires_at)
    .bind(Json(targeting))
    .bind(Json(plan.spec.as_ref()))
    .bind(plan.digest.to_string())
    .bind(plan.force)
    .bind(Json(StoredCounts::of(plan.counts)))
    .bind(Json(devices))
    .execute(&mut *tx)
    .await
    .context("keeping a plan")?;
    tx.commit().await.context("committing a kept plan")?;
    Ok(Ok(()))
}

/// Plan `id`'s slot and approval, `None` if it is not kept.
pub async fn kept(pool: &PgPool, id: Uuid) -> Result<Option<KeptPlan>, StoreError> {
    let row: Option<SlotRow> = sqlx::query_as(&format!(
        "SELECT {SLOT_COLUMNS} FROM plans p LEFT JOIN runs r ON r.plan_id = p.id WHERE p.id = $1"
    ))
    .bind(id)
    .fetch_optional(pool)
    .await
    .context("reading a plan")?;
    row.map(SlotRow::kept).transpose()
}

/// Plan `id`'s row locked until `tx` ends, as the book's rules read it.
async fn locked(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
) -> Result<Option<KeptPlan>, StoreError> {
    let row: Option<SlotRow> = sqlx::query_as(&format!(
        "SELECT {SLOT_COLUMNS} FROM plans p LEFT JOIN runs r ON r.plan_id = p.id \
         WHERE p.id = $1 FOR UPDATE OF p"
    ))
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
    .context("locking a plan")?;
    row.map(SlotRow::kept).transpose()
}

/// Records the approval `decide` gives plan `id` as it stands (`None`:
/// not kept), if it gives one.
pub async fn approve<R>(
    pool: &PgPool,
    id: Uuid,
    decide: impl FnOnce(Option<&KeptPlan>) -> Result<PlanApproval, R>,
) -> Result<Result<PlanApproval, R>, StoreError> {
    let mut tx = pool.begin().await.context("starting to approve a plan")?;
    let kept = locked(&mut tx, id).await?;
    let approval = match decide(kept.as_ref()) {
        Ok(approval) => approval,
        Err(refusal) => return Ok(Err(refusal)),
    };
    sqlx::query("UPDATE plans SET approved_by = $2, approved_at = $3 WHERE id = $1")
        .bind(id)
        .bind(&approval.by)
        .bind(approval.at)
        .execute(&mut *tx)
        .await
        .context("approving a plan")?;
    tx.commit().await.context("committing a plan's approval")?;
    Ok(Ok(approval))
}

/// Claims plan `id` for one call to apply at `now`, if `decide` lets it
/// (given the plan as it stands; `None`: not kept), with what `decide`
/// answers.
pub async fn claim<T, R>(
    pool: &PgPool,
    id: Uuid,
    now: DateTime<Utc>,
    decide: impl FnOnce(Option<&KeptPlan>) -> Result<T, R>,
) -> Result<Result<T, R>, StoreError> {
    let mut tx = pool.begin().await.context("starting to claim a plan")?;
    let kept = locked(&mut tx, id).await?;
    let claimed = match decide(kept.as_ref()) {
        Ok(claimed) => claimed,
        Err(refusal) => return Ok(Err(refusal)),
    };
    sqlx::query("UPDATE plans SET state = 'applying', claimed_at = $2 WHERE id = $1")
        .bind(id)
        .bind(now)
        .execute(&mut *tx)
        .await
        .context("claiming a plan")?;
    tx.commit().await.context("committing a plan's claim")?;
    Ok(Ok(claimed))
}

/// The claiming call's run applied plan `id`.
pub async fn applied(pool: &PgPool, id: Uuid, run: Uuid) -> Result<(), StoreError> {
    sqlx::query("UPDATE plans SET state = 'applied', applied_run = $2 WHERE id = $1")
        .bind(id)
        .bind(run)
        .execute(pool)
        .await
        .context("recording a plan applied")?;
    Ok(())
}

/// The claiming call did not apply plan `id`: it is open again.
pub async fn release(pool: &PgPool, id: Uuid) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE plans SET state = 'open', claimed_at = NULL WHERE id = $1 AND state = 'applying'",
    )
    .bind(id)
    .execute(pool)
    .await
    .context("releasing a plan's claim")?;
    Ok(())
}

/// Plan `id`'s content, `None` if it is not kept.
pub async fn content(pool: &PgPool, id: Uuid) -> Result<Option<Plan>, StoreError> {
    type ContentRow = (
        String,
        DateTime<Utc>,
        DateTime<Utc>,
        Json<TargetedRequest>,
        Json<Value>,
        String,
        bool,
        Json<StoredCounts>,
        Json<Vec<StoredDevice>>,
    );
    let row: Option<ContentRow> = sqlx::query_as(
        "SELECT author, created_at, expires_at, targeting, spec, digest, force, counts, devices \
         FROM plans WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
    .context("reading a plan's devices")?;
    let Some((author, created_at, expires_at, targeting, spec, digest, force, counts, devices)) =
        row
    else {
        return Ok(None);
    };
    const CONTEXT: &str = "reading a plan";
    let targeting = targeting
        .0
        .targeting(usize::MAX)
        .map_err(|e| corrupt(CONTEXT, e))?;
    let digest = SpecDigest::parse(&digest).map_err(|e| corrupt(CONTEXT, e))?;
    let devices = devices
        .0
        .into_iter()
        .map(StoredDevice::planned)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Plan {
        id,
        author,
        created_at,
        expires_at,
        targeting,
        spec: Arc::new(spec.0),
        digest,
        force,
        devices,
        counts: counts.0.counts(),
    }))
}

fn corrupt(context: &'static str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        context,
        detail: e.to_string(),
    }
}

/// Plan contents read lately, newest last: a plan's devices never change
/// once it is kept, so a page of them needs no read of the whole plan.
#[derive(Debug)]
pub struct PlanContents {
    capacity: usize,
    recent: Mutex<VecDeque<Arc<Plan>>>,
}

impl PlanContents {
    /// Holds at most `capacity` plans (each an entry per device it covers).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            recent: Mutex::new(VecDeque::new()),
        }
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<Plan>>> {
        // Each change is one push or removal: a panic cannot leave it
        // half-changed.
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers `plan`, just kept.
    pub fn remember(&self, plan: Arc<Plan>) {
        let mut recent = self.recent();
        recent.retain(|p| p.id != plan.id);
        if recent.len() >= self.capacity {
            recent.pop_front();
        }
        recent.push_back(plan);
    }

    /// Plan `id`'s content, from memory or the database.
    pub async fn get(&self, pool: &PgPool, id: Uuid) -> Result<Option<Arc<Plan>>, StoreError> {
        let known = self.recent().iter().find(|p| p.id == id).cloned();
        if let Some(plan) = known {
            return Ok(Some(plan));
        }
        let Some(plan) = content(pool, id).await? else {
            return Ok(None);
        };
        let plan = Arc::new(plan);
        self.remember(plan.clone());
        Ok(Some(plan))
    }
}

/// A plan's counts, in the order of [`PlanCounts`]'s fields.
#[derive(Serialize, Deserialize)]
struct StoredCounts([u64; 7]);

impl StoredCounts {
    fn of(c: PlanCounts) -> Self {
        Self([
            c.targets,
            c.converged,
            c.push,
            c.offline,
            c.quarantined,
            c.exempt,
            c.no_report,
        ])
    }

    fn counts(&self) -> PlanCounts {
        let [targets, converged, push, offline, quarantined, exempt, no_report] = self.0;
        PlanCounts {
            targets,
            converged,
            push,
            offline,
            quarantined,
            exempt,
            no_report,
        }
    }
}

/// One planned device, with short keys: a plan holds one per target.
#[derive(Serialize, Deserialize)]
struct StoredDevice {
    id: String,
    /// `converged`, `push`, `offline`, `quarantined`, `exempt`, `no_report`.
    v: String,
    g: i64,
    new: bool,
    /// The basis: desired generation, reported seq and report, owned
    /// field paths, online, status, exempt.
    dg: Option<i64>,
    rs: Option<i64>,
    r: Option<StoredReported>,
    o: Option<Vec<String>>,
    on: Option<bool>,
    s: DeviceStatus,
    x: bool,
}

#[derive(Serialize, Deserialize)]
struct StoredReported {
    d: SpecDigest,
    g: Option<i64>,
    j: Option<i64>,
}

const DEVICE_CONTEXT: &str = "reading a plan's device";

impl StoredDevice {
    fn of(d: &PlannedDevice) -> Self {
        let basis = &d.basis;
        Self {
            id: d.id.to_string(),
            v: verdict_name(d.verdict).to_owned(),
            g: stored_generation(d.generation),
            new: d.new_generation,
            dg: basis.desired_generation.map(stored_generation),
            rs: basis.reported_seq.map(to_i64),
            r: basis.reported.map(|r| StoredReported {
                d: r.digest,
                g: r.generation.map(stored_generation),
                j: r.rejected_generation.map(stored_generation),
            }),
            o: basis
                .owned
                .as_ref()
                .map(|owned| owned.paths().iter().map(ToString::to_string).collect()),
            on: basis.online,
            s: basis.status,
            x: basis.exempt,
        }
    }

    fn planned(self) -> Result<PlannedDevice, StoreError> {
        let owned = self
            .o
            .map(|paths| {
                paths
                    .iter()
                    .map(|p| parse_path(p).map_err(|e| corrupt(DEVICE_CONTEXT, e)))
                    .collect::<Result<Vec<_>, _>>()
                    .map(|paths| Arc::new(OwnedFields::new(paths)))
            })
            .transpose()?;
        Ok(PlannedDevice {
            id: device_id(&self.id, DEVICE_CONTEXT)?,
            verdict: verdict_named(&self.v)?,
            generation: generation(self.g),
            new_generation: self.new,
            basis: Basis {
                desired_generation: self.dg.map(generation),
                reported_seq: self.rs.map(to_u64),
                reported: self.r.map(|r| ReportedBasis {
                    digest: r.d,
                    generation: r.g.map(generation),
                    rejected_generation: r.j.map(generation),
                }),
                owned,
                online: self.on,
                status: self.s,
                exempt: self.x,
            },
        })
    }
}

fn verdict_name(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Converged => "converged",
        Verdict::Push => "push",
        Verdict::Skipped(PlanSkip::Blocked(Blocked::Offline)) => "offline",
        Verdict::Skipped(PlanSkip::Blocked(Blocked::Quarantined)) => "quarantined",
        Verdict::Skipped(PlanSkip::Blocked(Blocked::Exempt)) => "exempt",
        Verdict::Skipped(PlanSkip::NoReport) => "no_report",
    }
}

fn verdict_named(name: &str) -> Result<Verdict, StoreError> {
    Ok(match name {
        "converged" => Verdict::Converged,
        "push" => Verdict::Push,
        "offline" => Verdict::Skipped(PlanSkip::Blocked(Blocked::Offline)),
        "quarantined" => Verdict::Skipped(PlanSkip::Blocked(Blocked::Quarantined)),
        "exempt" => Verdict::Skipped(PlanSkip::Blocked(Blocked::Exempt)),
        "no_report" => Verdict::Skipped(PlanSkip::NoReport),
        other => return Err(corrupt(DEVICE_CONTEXT, format!("verdict {other:?}"))),
    })
}
