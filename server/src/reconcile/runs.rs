//! Starting a run: commits the desired change (if any), the run, its targets
//! and the `run.started` event in one transaction, then mirrors the desired
//! change in the fleet cache. Shared by the API and the engine's own triggers.

use std::sync::Arc;

use idem_protocol::{DeviceId, SpecDigest};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::run::RunSpec;
pub use super::run::Trigger;
use crate::events::{self, EventDraft, EventError, RunStartedData};
use crate::fleet::{DesiredState, Fleet, FleetChange};
use crate::store::{self, Context, DeviceWrites, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum CommitRunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Event(#[from] EventError),
}

/// A run to commit.
#[derive(Debug)]
pub struct NewRun {
    pub targets: Vec<DeviceId>,
    pub trigger: Trigger,
    pub force: bool,
    /// New desired spec for every target, if this run changes desired state.
    pub spec: Option<Value>,
    /// The operator token that started it (`None`: the server itself).
    pub started_by: Option<String>,
}

/// Commits `run`; the caller hands the result to the engine.
pub async fn commit_run(
    pool: &PgPool,
    device_writes: &DeviceWrites,
    fleet: &Fleet,
    event_source: &str,
    run: NewRun,
) -> Result<RunSpec, CommitRunError> {
    let run_id = Uuid::now_v7();
    let target_ids: Vec<String> = run.targets.iter().map(DeviceId::to_string).collect();
    // Only a desired change updates many device rows.
    let _one_writer = match run.spec {
        Some(_) => Some(device_writes.lock().await),
        None => None,
    };
    let mut tx = pool.begin().await.context("starting a transaction")?;
    let digest_and_spec = run.spec.map(|spec| (SpecDigest::of(&spec), Arc::new(spec)));
    let mut desired_changes = Vec::new();
    if let Some((digest, spec)) = &digest_and_spec {
        desired_changes =
            store::devices::set_desired(&mut tx, &target_ids, spec, &digest.to_string()).await?;
    }
    store::runs::create(
        &mut tx,
        store::runs::NewRunRow {
            id: run_id,
            trigger: run.trigger.as_str(),
            force: run.force,
            started_by: run.started_by.as_deref(),
        },
        &target_ids,
    )
    .await?;
    let draft = EventDraft::run_started(
        run_id,
        RunStartedData {
            trigger: run.trigger.as_str().to_owned(),
            target_count: target_ids.len() as u64,
            force: run.force,
            started_by: run.started_by,
        },
    );
    let first = store::events::reserve_sequences(&mut tx, 1).await?;
    let rows = events::finalize(vec![draft], first, event_source, chrono::Utc::now())?;
    store::events::insert(&mut tx, &rows).await?;
    tx.commit().await.context("committing a run")?;
    if let Some((digest, spec)) = digest_and_spec {
        fleet.apply(desired_changes.into_iter().filter_map(|write| {
            let id = DeviceId::parse(&write.id).ok()?;
            let desired = DesiredState {
                generation: store::to_u64(write.desired_generation),
                digest,
                spec: spec.clone(),
            };
            Some(FleetChange::Desired(id, desired))
        }));
    }
    Ok(RunSpec {
        id: run_id,
        trigger: run.trigger,
        targets: run.targets,
        force: run.force,
        decided: 0,
    })
}
