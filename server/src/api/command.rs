//! The command layer: every API call that changes devices or starts a run
//! goes through here, in one order — the `DeviceWrites` lock, one
//! transaction, the commit, then the fleet cache (`Fleet::apply`, only after
//! the commit), then the engine. Handlers validate and answer; they do not
//! commit or touch the cache themselves. The answer of a mutating call
//! carries its `AuditNote` from here too ([`audited`]).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem_protocol::DeviceId;
use serde::Serialize;
use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::api_error::ApiError;
use crate::auth::{Actor, AuditNote};
use crate::fleet::FleetChange;
use crate::reconcile::engine::EngineCommand;
use crate::reconcile::runs::{commit_run, CommitRunError, NewRun, Trigger};
use crate::state::AppState;
use crate::store::{self, Context};

/// A JSON answer carrying what the call did, for the audit trail.
pub(super) fn audited(note: AuditNote, status: StatusCode, body: impl Serialize) -> Response {
    (status, Extension(note), Json(body)).into_response()
}

/// One write to device rows: holds the `DeviceWrites` lock and a
/// transaction, and collects the cache changes and engine commands that
/// follow it, which [`DeviceWrite::commit`] carries out after the commit.
pub(super) struct DeviceWrite<'a> {
    state: &'a AppState,
    /// Transactions over many device rows are serialised (see
    /// `store::DeviceWrites`); held until the cache mirrors the commit.
    lock: tokio::sync::MutexGuard<'a, ()>,
    tx: Transaction<'static, Postgres>,
    changes: Vec<FleetChange>,
    then: Vec<EngineCommand>,
}

impl<'a> DeviceWrite<'a> {
    /// Takes the lock and starts the transaction.
    pub(super) async fn begin(state: &'a AppState) -> Result<Self, ApiError> {
        let lock = state.device_writes.lock().await;
        let tx = state.pool.begin().await.context("starting a transaction")?;
        Ok(Self {
            state,
            lock,
            tx,
            changes: Vec::new(),
            then: Vec::new(),
        })
    }

    pub(super) fn tx(&mut self) -> &mut Transaction<'static, Postgres> {
        &mut self.tx
    }

    /// Cache changes to apply once the transaction has committed.
    pub(super) fn change(&mut self, changes: impl IntoIterator<Item = FleetChange>) {
        self.changes.extend(changes);
    }

    /// A command for the engine once the cache is updated.
    pub(super) fn then_tell(&mut self, command: EngineCommand) {
        self.then.push(command);
    }

    /// Commits (`what` names the write in an error), applies the cache
    /// changes, releases the lock, then tells the engine. An engine that has
    /// stopped is not told: what it would do is redone at its next start.
    pub(super) async fn commit(self, what: &'static str) -> Result<(), ApiError> {
        let Self {
            state,
            lock,
            tx,
            changes,
            then,
        } = self;
        tx.commit().await.context(what)?;
        state.fleet.apply(changes);
        drop(lock);
        for command in then {
            tell(state, command).await;
        }
        Ok(())
    }
}

/// Releases quarantined devices among `ids` and mirrors it in the cache;
/// returns the released ones.
pub(super) async fn release(state: &AppState, ids: Vec<String>) -> Result<Vec<DeviceId>, ApiError> {
    let released = store::devices::release_quarantine(&state.pool, &ids).await?;
    let released: Vec<DeviceId> = released
        .iter()
        .filter_map(|id| DeviceId::parse(id).ok())
        .collect();
    state
        .fleet
        .apply(released.iter().cloned().map(FleetChange::Released));
    Ok(released)
}

/// Commits a run (with the desired change, if any, and its `run.started`
/// event; `commit_run` applies its own cache changes) and hands it to the
/// engine. Returns the run id.
pub(super) async fn start_run(
    state: &AppState,
    actor: &Actor,
    targets: Vec<DeviceId>,
    trigger: Trigger,
    force: bool,
    spec: Option<Value>,
) -> Result<Uuid, ApiError> {
    let run = NewRun {
        targets,
        trigger,
        force,
        spec,
        started_by: Some(actor.name.clone()),
    };
    let run = commit_run(
        &state.pool,
        &state.device_writes,
        &state.fleet,
        &state.event_source,
        run,
    )
    .await
    .map_err(|e| match e {
        CommitRunError::Store(e) => ApiError::from(e),
        CommitRunError::Event(e) => ApiError::from(e),
    })?;
    state.events_wake.notify_one();
    state.metrics.events_committed.increment(1);
    let run_id = run.id;
    state
        .engine
        .send(EngineCommand::StartRun(run))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the server is shutting down; the run resumes at next start",
            )
        })?;
    Ok(run_id)
}

/// Tells the engine about a change committed earlier; an engine that has
/// stopped is not told (what it would do is redone at its next start).
pub(super) async fn tell(state: &AppState, command: EngineCommand) {
    let _ = state.engine.send(command).await;
}
