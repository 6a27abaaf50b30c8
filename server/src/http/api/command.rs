//! The command layer: every API call that changes devices or starts a run
//! goes through here, in one order — the device writer's transaction
//! (`store::DeviceWriter`), the commit, which mirrors the change in the
//! fleet cache, then the engine. Handlers validate and answer; they do not
//! commit or touch the cache themselves. Every change commits with its
//! audit record in the same transaction ([`DeviceWrite::commit`],
//! [`start_run`]), answered by [`recorded`]; a mutating call that changed
//! nothing carries its `AuditNote` for the middleware ([`audited`]).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem_protocol::api::ErrorCode;
use idem_protocol::DeviceId;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::engine::new_run::{CommitRunError, NewRun};
use crate::engine::EngineCommand;
use crate::engine::{RunAnswer, RunRequest};
use crate::http::auth::{AuditNote, AuditWritten, Call};
use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::reconcile::owned::OwnedFieldSet;
use crate::store::access::AuditRecord;
use crate::store::cache::FleetChange;
use crate::store::{self, DeviceTx};

/// A JSON answer carrying what the call did, for the audit record the
/// middleware writes (a call that changed nothing).
pub(super) fn audited(note: AuditNote, status: StatusCode, body: impl Serialize) -> Response {
    (status, Extension(note), Json(body)).into_response()
}

/// A JSON answer to a call whose change committed with its audit record.
pub(super) fn recorded(status: StatusCode, body: impl Serialize) -> Response {
    (status, Extension(AuditWritten), Json(body)).into_response()
}

/// Device ids an audit record names, at most (the count is always there).
pub(super) const MAX_AUDITED_IDS: usize = 20;

/// `{"count": n, "first": [the first ids]}`, for an audit record's detail.
pub(super) fn audited_ids<'a>(ids: impl IntoIterator<Item = &'a str>) -> Value {
    let mut count = 0usize;
    let mut first = Vec::new();
    for id in ids {
        if first.len() < MAX_AUDITED_IDS {
            first.push(id);
        }
        count += 1;
    }
    serde_json::json!({"count": count, "first": first})
}

/// One write to device rows through the server's [`DeviceWriter`]: a
/// [`DeviceTx`] plus the engine commands that follow it, which
/// [`DeviceWrite::commit`] sends once the commit is mirrored in the cache.
pub(super) struct DeviceWrite<'a> {
    state: &'a AppState,
    write: DeviceTx<'a>,
    then: Vec<EngineCommand>,
}

impl<'a> DeviceWrite<'a> {
    /// Waits for the writer and starts the transaction.
    pub(super) async fn begin(state: &'a AppState) -> Result<Self, ApiError> {
        let write = state.writer.begin().await?;
        Ok(Self {
            state,
            write,
            then: Vec::new(),
        })
    }

    /// The device transaction, for `store::devices`.
    pub(super) fn tx(&mut self) -> &mut DeviceTx<'a> {
        &mut self.write
    }

    /// Cache changes to apply once the transaction has committed.
    pub(super) fn change(&mut self, changes: impl IntoIterator<Item = FleetChange>) {
        self.write.mirror(changes);
    }

    /// Brings the cache's exemption flags of `scope` up to date in this
    /// transaction; once it commits, the engine stops the attempts on the
    /// devices an exemption now covers and reconciles those whose exemption
    /// ends.
    pub(super) async fn refresh_exemptions(
        &mut self,
        scope: store::Scope<'_>,
    ) -> Result<(), ApiError> {
        let moved = store::exemptions::refresh(&mut self.write, &self.state.fleet, scope).await?;
        if !moved.started.is_empty() {
            self.then
                .push(EngineCommand::ExemptionsStarted(moved.started));
        }
        if !moved.ended.is_empty() {
            self.then.push(EngineCommand::ExemptionsEnded(moved.ended));
        }
        Ok(())
    }

    /// Brings the cache's owned fields of `scope` up to date with `set` in
    /// this transaction; once it commits, the engine republishes the
    /// retained desired messages the change concerns and, with `recheck`,
    /// re-judges the devices whose owned fields changed (converging or
    /// reconciling them). Returns those devices.
    pub(super) async fn refresh_owned(
        &mut self,
        set: &OwnedFieldSet,
        scope: store::Scope<'_>,
        recheck: bool,
    ) -> Result<Vec<DeviceId>, ApiError> {
        let refreshed = store::owned::refresh(&mut self.write, set, scope).await?;
        if !refreshed.devices.is_empty() {
            self.then.push(EngineCommand::OwnedChanged {
                changed: if recheck {
                    refreshed.devices.clone()
                } else {
                    Vec::new()
                },
                republish: refreshed.republish,
            });
        }
        Ok(refreshed.devices)
    }

    /// Brings the owned fields of devices whose labels may have changed up
    /// to date with the declared set, and has the engine re-judge them.
    /// Returns the devices whose owned paths changed.
    pub(super) async fn refresh_owned_of(
        &mut self,
        ids: &[DeviceId],
    ) -> Result<Vec<DeviceId>, ApiError> {
        let set = self.state.fleet.owned_set();
        self.refresh_owned(&set, store::Scope::Devices(ids), true)
            .await
    }

    /// A command for the engine once the cache is updated.
    pub(super) fn then_tell(&mut self, command: EngineCommand) {
        self.then.push(command);
    }

    /// Writes `audit` and commits with it (`what` names the write in an
    /// error), which mirrors the cache changes and releases the writer,
    /// then tells the engine. An engine that has stopped is not told: what
    /// it would do is redone at its next start.
    pub(super) async fn commit(
        self,
        what: &'static str,
        audit: AuditRecord,
    ) -> Result<(), ApiError> {
        let Self {
            state,
            mut write,
            then,
        } = self;
        store::access::record_audit(&mut **write.tx(), &audit).await?;
        write.commit(what).await?;
        for command in then {
            tell(state, command).await;
        }
        Ok(())
    }
}

/// Has the engine commit `run` as started by this call (with the desired
/// change or the release it carries, its `run.started` event and the call's
/// audit record with what `note` says, completed with the run id) and start
/// it. Returns the run id and how many devices it targets.
pub(super) async fn start_run(
    state: &AppState,
    call: &Call,
    run: NewRun,
    note: AuditNote,
) -> Result<(Uuid, usize), ApiError> {
    let answer = ask_engine(state, call, run, Some(note), false).await?;
    Ok((answer.run_id, answer.targets))
}

/// As [`start_run`], for a run that follows a change this call already
/// committed with its audit record: the run carries no record of its own.
pub(super) async fn start_follow_up_run(
    state: &AppState,
    call: &Call,
    run: NewRun,
) -> Result<(Uuid, usize), ApiError> {
    let answer = ask_engine(state, call, run, None, false).await?;
    Ok((answer.run_id, answer.targets))
}

/// As [`start_run`], unless a manual run over the same targets with the
/// same force is still running: then nothing is committed and the answer
/// is that run, `joined` (the caller's middleware records the call).
pub(super) async fn start_or_join_manual_run(
    state: &AppState,
    call: &Call,
    run: NewRun,
    note: AuditNote,
) -> Result<RunAnswer, ApiError> {
    ask_engine(state, call, run, Some(note), true).await
}

async fn ask_engine(
    state: &AppState,
    call: &Call,
    mut run: NewRun,
    note: Option<AuditNote>,
    join_identical: bool,
) -> Result<RunAnswer, ApiError> {
    run.started_by = Some(call.actor.name.clone());
    run.audit = note.map(|note| call.audit(StatusCode::OK, note));
    let shutting_down = || {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::ShuttingDown,
            "the server is shutting down; nothing was started, try again once it is back",
        )
    };
    let (reply, answer) = oneshot::channel();
    let request = RunRequest {
        run,
        join_identical,
        reply,
    };
    state
        .run_requests
        .send(request)
        .await
        .map_err(|_| shutting_down())?;
    let answer = answer.await.map_err(|_| shutting_down())?;
    answer.map_err(|e| match e {
        CommitRunError::Store(e) => ApiError::from(e),
        CommitRunError::Event(e) => ApiError::from(e),
        CommitRunError::NothingQuarantined => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::NotQuarantined,
            "none of the devices to retry is quarantined (any more)",
        ),
        CommitRunError::PlanStale(staleness) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::PlanStale,
            format!("the plan no longer describes the fleet: {staleness}"),
        ),
    })
}

/// Tells the engine about a change committed earlier; an engine that has
/// stopped is not told (what it would do is redone at its next start).
pub(super) async fn tell(state: &AppState, command: EngineCommand) {
    let _ = state.engine.send(command).await;
}
