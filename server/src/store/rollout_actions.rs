//! Rollout actions asked through an instance without the engine: the
//! `rollout_actions` rows the asker writes and polls, and the engine's
//! holder claims and answers.

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::{Context, StoreError};

/// An action waiting for the engine's holder.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AskedAction {
    pub id: Uuid,
    pub run_id: Uuid,
    /// `resume`, `abort` or `approve`.
    pub action: String,
    /// The token that asked (the approver, for `approve`).
    pub by: String,
}

/// The holder's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ActionAnswer {
    /// Carried out: the rollout as stored after it.
    Done(Value),
    /// Refused: why (`self_approval`, `not_in_progress`, `not_now`) and the
    /// message.
    Refused { refusal: String, message: String },
}

/// Asks for `action` on `run_id`; returns the row's id.
pub async fn ask(pool: &PgPool, run_id: Uuid, action: &str, by: &str) -> Result<Uuid, StoreError> {
    let id = Uuid::now_v7();
    sqlx::query("INSERT INTO rollout_actions (id, run_id, action, by) VALUES ($1, $2, $3, $4)")
        .bind(id)
        .bind(run_id)
        .bind(action)
        .bind(by)
        .execute(pool)
        .await
        .context("asking the engine's holder for a rollout action")?;
    Ok(id)
}

/// The answer to action `id`, deleting the row once answered.
pub async fn take_answer(pool: &PgPool, id: Uuid) -> Result<Option<ActionAnswer>, StoreError> {
    let row: Option<(Option<Value>, Option<String>, Option<String>)> = sqlx::query_as(
        "DELETE FROM rollout_actions WHERE id = $1 AND answered_at IS NOT NULL \
         RETURNING answer, refusal, message",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
    .context("reading the answer to a rollout action")?;
    Ok(
        row.map(|(answer, refusal, message)| match (answer, refusal) {
            (Some(answer), None) => ActionAnswer::Done(answer),
            (_, refusal) => ActionAnswer::Refused {
                refusal: refusal.unwrap_or_default(),
                message: message.unwrap_or_default(),
            },
        }),
    )
}

/// Withdraws action `id` unless the holder claimed it already; `true` when
/// it was withdrawn (it will never be carried out).
pub async fn withdraw(pool: &PgPool, id: Uuid) -> Result<bool, StoreError> {
    let done = sqlx::query("DELETE FROM rollout_actions WHERE id = $1 AND claimed_by IS NULL")
        .bind(id)
        .execute(pool)
        .await
        .context("withdrawing a rollout action")?;
    Ok(done.rows_affected() > 0)
}

/// Claims every action nobody claimed, oldest first, for holder `me`; and
/// forgets the rows nobody read for a minute (their askers gave up).
pub async fn claim(pool: &PgPool, me: Uuid) -> Result<Vec<AskedAction>, StoreError> {
    sqlx::query("DELETE FROM rollout_actions WHERE asked_at < now() - interval '1 minute'")
        .execute(pool)
        .await
        .context("forgetting rollout actions nobody read")?;
    sqlx::query_as(
        "UPDATE rollout_actions SET claimed_by = $1 WHERE id IN \
             (SELECT id FROM rollout_actions WHERE claimed_by IS NULL \
              ORDER BY asked_at LIMIT 64 FOR UPDATE SKIP LOCKED) \
         RETURNING id, run_id, action, by",
    )
    .bind(me)
    .fetch_all(pool)
    .await
    .context("claiming rollout actions")
}

/// Writes the answer to action `id`.
pub async fn answer(pool: &PgPool, id: Uuid, answer: &ActionAnswer) -> Result<(), StoreError> {
    let (done, refusal, message) = match answer {
        ActionAnswer::Done(stored) => (Some(stored), None, None),
        ActionAnswer::Refused { refusal, message } => {
            (None, Some(refusal.as_str()), Some(message.as_str()))
        }
    };
    sqlx::query(
        "UPDATE rollout_actions SET answered_at = now(), answer = $2, refusal = $3, message = $4 \
         WHERE id = $1",
    )
    .bind(id)
    .bind(done)
    .bind(refusal)
    .bind(message)
    .execute(pool)
    .await
    .context("answering a rollout action")?;
    Ok(())
}

/// Hands action `id` back, unclaimed, for the next holder.
pub async fn unclaim(pool: &PgPool, id: Uuid) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE rollout_actions SET claimed_by = NULL WHERE id = $1 AND answered_at IS NULL",
    )
    .bind(id)
    .execute(pool)
    .await
    .context("handing a rollout action back")?;
    Ok(())
}
