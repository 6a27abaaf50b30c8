//! Runs and their per-device targets/outcomes.

use chrono::{DateTime, Utc};
use idem_protocol::{DeviceId, Generation, Health, OutcomeCounts, OutcomeKind, RunState, Trigger};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::copy::copy_in;
use super::{stored_generation, to_i64, Context, StoreError};
use crate::reconcile::machine::OutcomeRecord;
use crate::reconcile::plan::PlanApproval;
use crate::tuning::CONVERGED_SLICE;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RunRow {
    pub id: Uuid,
    pub trigger: Trigger,
    pub state: RunState,
    pub force: bool,
    pub target_count: i32,
    pub already_converged: i32,
    pub provisioned: i32,
    pub failed: i32,
    pub skipped: i32,
    pub superseded: i32,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub started_by: Option<String>,
    /// The plan this run applied.
    pub plan_id: Option<Uuid>,
    /// Its rollout as stored ([`crate::reconcile::rollout::StoredRollout`]).
    pub rollout: Option<sqlx::types::Json<serde_json::Value>>,
    /// Who approved the plan it applied, and when.
    pub approved_by: Option<String>,
    pub approved_at: Option<DateTime<Utc>>,
}

impl RunRow {
    pub fn counts(&self) -> OutcomeCounts {
        let n = |v: i32| u64::try_from(v).unwrap_or(0);
        OutcomeCounts {
            already_converged: n(self.already_converged),
            provisioned: n(self.provisioned),
            failed: n(self.failed),
            skipped: n(self.skipped),
            superseded: n(self.superseded),
        }
    }
}

const RUN_COLUMNS: &str =
    "id, trigger, state, force, target_count, already_converged, provisioned, \
    failed, skipped, superseded, started_at, finished_at, started_by, plan_id, rollout, \
    approved_by, approved_at";

/// The run row to insert.
#[derive(Debug, Clone, Copy)]
pub struct NewRunRow<'a> {
    pub id: Uuid,
    pub trigger: Trigger,
    pub force: bool,
    pub started_by: Option<&'a str>,
    pub plan_id: Option<Uuid>,
    pub approval: Option<&'a PlanApproval>,
}

/// A target whose outcome (`already_converged`) is known when its run is
/// created.
#[derive(Debug, Clone)]
pub struct ConvergedTarget<'a> {
    pub device_id: &'a DeviceId,
    pub generation: Generation,
    pub health: Option<Health>,
}

/// Inserts the run and its targets: `undecided` without an outcome (each
/// with its rollout wave, if any, and whether its report differed from its
/// desired spec), one `run_targets` row each; `converged` already decided
/// (and counted in the run's row), in slices of `CONVERGED_SLICE` per
/// `run_converged` row.
pub async fn create(
    tx: &mut Transaction<'_, Postgres>,
    run: NewRunRow<'_>,
    undecided: &[(DeviceId, Option<usize>, bool)],
    converged: &[ConvergedTarget<'_>],
) -> Result<(), StoreError> {
    let id = run.id;
    let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    sqlx::query(
        "INSERT INTO runs (id, trigger, force, target_count, started_by, already_converged, \
         plan_id, approved_by, approved_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(id)
    .bind(run.trigger)
    .bind(run.force)
    .bind(count(undecided.len() + converged.len()))
    .bind(run.started_by)
    .bind(count(converged.len()))
    .bind(run.plan_id)
    .bind(run.approval.map(|a| a.by.as_str()))
    .bind(run.approval.map(|a| a.at))
    .execute(&mut **tx)
    .await
    .context("creating a run")?;
    insert_converged(tx, id, converged).await?;
    if undecided.is_empty() {
        return Ok(());
    }
    copy_in(
        tx,
        "COPY run_targets (run_id, device_id, wave, differed) FROM STDIN",
        "recording run targets",
        undecided,
        |row, (device, wave, differed)| {
            row.plain(id).text(device.as_str());
            match wave {
                Some(wave) => row.plain(wave),
                None => row.null(),
            };
            row.plain(if *differed { "t" } else { "f" });
        },
    )
    .await?;
    Ok(())
}

/// The converged targets of run `run_id`, in device order, one
/// `run_converged` row per `CONVERGED_SLICE` of them (one statement; the
/// database computes each slice's last device in its own collation).
async fn insert_converged(
    tx: &mut Transaction<'_, Postgres>,
    run_id: Uuid,
    converged: &[ConvergedTarget<'_>],
) -> Result<(), StoreError> {
    if converged.is_empty() {
        return Ok(());
    }
    let mut sorted: Vec<&ConvergedTarget<'_>> = converged.iter().collect();
    sorted.sort_unstable_by(|a, b| a.device_id.as_str().cmp(b.device_id.as_str()));
    let device_ids: Vec<&str> = sorted.iter().map(|t| t.device_id.as_str()).collect();
    let generations: Vec<i64> = sorted
        .iter()
        .map(|t| stored_generation(t.generation))
        .collect();
    let health: Vec<Option<&str>> = sorted
        .iter()
        .map(|t| t.health.map(Health::as_str))
        .collect();
    let slice_size = i64::try_from(CONVERGED_SLICE).unwrap_or(i64::MAX);
    sqlx::query(
        "INSERT INTO run_converged \
             (run_id, slice, last_device, device_ids, generations, health, decided_at) \
         SELECT $1, ((u.ord - 1) / $5)::int4, max(u.device_id), \
             array_agg(u.device_id ORDER BY u.ord), array_agg(u.generation ORDER BY u.ord), \
             array_agg(u.health ORDER BY u.ord), now() \
         FROM unnest($2::text[], $3::int8[], $4::text[]) WITH ORDINALITY \
             AS u(device_id, generation, health, ord) \
         GROUP BY (u.ord - 1) / $5",
    )
    .bind(run_id)
    .bind(&device_ids)
    .bind(&generations)
    .bind(&health)
    .bind(slice_size)
    .execute(&mut **tx)
    .await
    .context("recording the converged targets of a run")?;
    Ok(())
}

/// Stores outcomes and adds them to the runs' counts, in the caller's
/// transaction (the devices' last outcome is a device change).
pub async fn record_outcomes(
    tx: &mut Transaction<'_, Postgres>,
    rows: &[OutcomeRecord],
    per_run: &[(Uuid, OutcomeCounts)],
) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let run_ids: Vec<Uuid> = rows.iter().map(|r| r.run_id).collect();
    let device_ids: Vec<&str> = rows.iter().map(|r| r.device.as_str()).collect();
    let outcomes: Vec<OutcomeKind> = rows.iter().map(|r| r.kind).collect();
    let reasons: Vec<Option<&str>> = rows.iter().map(|r| r.reason.as_deref()).collect();
    let generations: Vec<Option<i64>> = rows
        .iter()
        .map(|r| r.generation.map(stored_generation))
        .collect();
    let health: Vec<Option<Health>> = rows.iter().map(|r| r.health).collect();
    sqlx::query(
        "UPDATE run_targets t SET outcome = r.outcome, reason = r.reason, generation = r.generation, \
             health = r.health, decided_at = now() \
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[]) \
             AS r(run_id, device_id, outcome, reason, generation, health) \
         WHERE t.run_id = r.run_id AND t.device_id = r.device_id AND t.outcome IS NULL",
    )
    .bind(&run_ids)
    .bind(&device_ids)
    .bind(&outcomes)
    .bind(&reasons)
    .bind(&generations)
    .bind(&health)
    .execute(&mut **tx)
    .await
    .context("storing run outcomes")?;
    let ids: Vec<Uuid> = per_run.iter().map(|(id, _)| *id).collect();
    let col = |f: fn(&OutcomeCounts) -> u64| -> Vec<i64> {
        per_run.iter().map(|(_, c)| to_i64(f(c))).collect()
    };
    sqlx::query(
        "UPDATE runs SET already_converged = already_converged + r.ac, provisioned = provisioned + r.pr, \
             failed = failed + r.fa, skipped = skipped + r.sk, superseded = superseded + r.su \
         FROM UNNEST($1::uuid[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[]) \
             AS r(id, ac, pr, fa, sk, su) \
         WHERE runs.id = r.id",
    )
    .bind(&ids)
    .bind(col(|c| c.already_converged))
    .bind(col(|c| c.provisioned))
    .bind(col(|c| c.failed))
    .bind(col(|c| c.skipped))
    .bind(col(|c| c.superseded))
    .execute(&mut **tx)
    .await
    .context("adding to run counts")?;
    Ok(())
}

/// Stores the rollouts of a write as their run rows keep them, in the
/// caller's transaction.
pub async fn store_rollouts(
    tx: &mut Transaction<'_, Postgres>,
    rollouts: &[(Uuid, serde_json::Value)],
) -> Result<(), StoreError> {
    if rollouts.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rollouts.iter().map(|(id, _)| *id).collect();
    let states: Vec<sqlx::types::Json<&serde_json::Value>> = rollouts
        .iter()
        .map(|(_, state)| sqlx::types::Json(state))
        .collect();
    sqlx::query(
        "UPDATE runs SET rollout = r.rollout          FROM UNNEST($1::uuid[], $2::jsonb[]) AS r(id, rollout) WHERE runs.id = r.id",
    )
    .bind(&ids)
    .bind(&states)
    .execute(&mut **tx)
    .await
    .context("storing rollout states")?;
    Ok(())
}

/// Marks runs completed; returns the ids of those this call completed (a
/// run some other writer completed already is not among them). Their counts
/// are the machine's to announce; the row's own were added by
/// [`record_outcomes`].
pub async fn complete(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[Uuid],
) -> Result<Vec<Uuid>, StoreError> {
    sqlx::query_scalar(
        "UPDATE runs SET state = $2, finished_at = now() \
         WHERE id = ANY($1) AND state = $3 RETURNING id",
    )
    .bind(ids)
    .bind(RunState::Completed)
    .bind(RunState::Running)
    .fetch_all(&mut **tx)
    .await
    .context("completing runs")
}

/// The rows of runs `ids` as the caller's transaction sees them.
pub async fn get_many_in(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[Uuid],
) -> Result<Vec<RunRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {RUN_COLUMNS} FROM runs WHERE id = ANY($1)"
    ))
    .bind(ids)
    .fetch_all(&mut **tx)
    .await
    .context("reading runs")
}

pub async fn get(pool: &PgPool, id: Uuid) -> Result<Option<RunRow>, StoreError> {
    sqlx::query_as(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = $1"))
        .bind(id)
        .fetch_optional(pool)
        .await
        .context("reading a run")
}

/// Newest first; `before` is a keyset cursor on `started_at`.
pub async fn list(
    pool: &PgPool,
    before: Option<DateTime<Utc>>,
    limit: i64,
) -> Result<Vec<RunRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {RUN_COLUMNS} FROM runs WHERE ($1::timestamptz IS NULL OR started_at < $1) \
         ORDER BY started_at DESC, id LIMIT $2"
    ))
    .bind(before)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("listing runs")
}

/// Runs left `running` by an earlier process.
pub async fn unfinished(pool: &PgPool) -> Result<Vec<RunRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {RUN_COLUMNS} FROM runs WHERE state = $1 ORDER BY started_at"
    ))
    .bind(RunState::Running)
    .fetch_all(pool)
    .await
    .context("listing unfinished runs")
}

/// Targets of a run that have no outcome yet, with their waves and whether
/// their report differed from their desired spec when the run was created.
pub async fn undecided_waves(
    pool: &PgPool,
    run_id: Uuid,
) -> Result<Vec<(DeviceId, Option<i16>, bool)>, StoreError> {
    const CONTEXT: &str = "listing the undecided targets of a rollout";
    let rows: Vec<(String, Option<i16>, bool)> = sqlx::query_as(
        "SELECT device_id, wave, differed FROM run_targets WHERE run_id = $1 AND outcome IS NULL \
         ORDER BY device_id",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .context(CONTEXT)?;
    rows.into_iter()
        .map(|(id, wave, differed)| Ok((super::device_id(&id, CONTEXT)?, wave, differed)))
        .collect()
}

#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct TargetRow {
    pub device_id: String,
    pub outcome: Option<OutcomeKind>,
    pub reason: Option<String>,
    pub generation: Option<i64>,
    pub health: Option<Health>,
    pub decided_at: Option<DateTime<Utc>>,
}

/// A page of a run's per-device outcomes, by device id: its `run_targets`
/// rows and its converged slices (`run_converged`, skipped whole when
/// every device in them is at or before `after`), merged.
pub async fn outcomes(
    pool: &PgPool,
    run_id: Uuid,
    outcome: Option<OutcomeKind>,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<TargetRow>, StoreError> {
    sqlx::query_as(
        "SELECT device_id, outcome, reason, generation, health, decided_at FROM ( \
             (SELECT device_id, outcome, reason, generation, health, decided_at FROM run_targets \
              WHERE run_id = $1 AND ($2::text IS NULL OR outcome = $2) \
                  AND ($3::text IS NULL OR device_id > $3) \
              ORDER BY device_id LIMIT $4) \
             UNION ALL \
             (SELECT u.device_id, 'already_converged', NULL, u.generation, u.health, c.decided_at \
              FROM run_converged c, \
                  unnest(c.device_ids, c.generations, c.health) AS u(device_id, generation, health) \
              WHERE c.run_id = $1 AND ($2::text IS NULL OR $2 = 'already_converged') \
                  AND ($3::text IS NULL OR (c.last_device > $3 AND u.device_id > $3)) \
              ORDER BY u.device_id LIMIT $4) \
         ) page ORDER BY device_id LIMIT $4",
    )
    .bind(run_id)
    .bind(outcome)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("listing run outcomes")
}

/// Those of `ids` whose runs are completed.
pub async fn completed_among(pool: &PgPool, ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT id FROM runs WHERE id = ANY($1) AND state = $2")
        .bind(ids)
        .bind(RunState::Completed)
        .fetch_all(pool)
        .await
        .context("reading which runs are completed")
}

/// Deletes completed runs (their targets go with them) that finished before
/// `max_age` ago, or that lie beyond the newest runs whose targets add up to
/// `max_targets`, at most `batch` runs per call. Returns how many runs were
/// deleted; call again while it returns `batch`.
pub async fn prune(
    pool: &PgPool,
    max_age: std::time::Duration,
    max_targets: i64,
    batch: i64,
) -> Result<u64, StoreError> {
    let max_age = chrono::Duration::from_std(max_age).unwrap_or(chrono::Duration::MAX);
    let cutoff = Utc::now()
        .checked_sub_signed(max_age)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let deleted = sqlx::query(
        "DELETE FROM runs WHERE id IN ( \
             SELECT id FROM ( \
                 SELECT id, finished_at, \
                        sum(target_count) OVER (ORDER BY started_at DESC, id DESC) AS newer_targets \
                 FROM runs WHERE state = $4 \
             ) r WHERE r.finished_at < $1 OR r.newer_targets > $2 \
             ORDER BY id LIMIT $3)",
    )
    .bind(cutoff)
    .bind(max_targets)
    .bind(batch)
    .bind(RunState::Completed)
    .execute(pool)
    .await
    .context("pruning old runs")?
    .rows_affected();
    Ok(deleted)
}
