//! Starting a run: reads what the core needs to judge it, commits the
//! desired change (if any), the run, its targets and its first events as
//! `reconcile::creation` judged them, in one transaction, then mirrors the
//! desired change in the fleet cache. Shared by the API and the engine's
//! own triggers.

use std::collections::HashSet;
use std::sync::Arc;

use idem_protocol::api::Targeting;
use idem_protocol::{DeviceId, OutcomeKind, SpecDigest};
use serde_json::Value;
use uuid::Uuid;

use crate::events::{self, EventError};
use crate::ops::metrics::Metrics;
use crate::reconcile::change::DeviceChange;
use crate::reconcile::creation::{
    judge_new_run, plan_freshness, released_targets, JudgedRun, RunToJudge,
};
use crate::reconcile::device::DeviceEntry;
use crate::reconcile::owned::NewSpecDigests;
use crate::reconcile::plan::{Plan, PlanApproval, Staleness};
use crate::reconcile::rollout::RolloutSpec;
use crate::reconcile::run::RunSpec;
pub use crate::reconcile::run::Trigger;
use crate::store::access::AuditRecord;
use crate::store::cache::{DesiredState, FleetChange};
use crate::store::devices::DeviceChangeRow;
use crate::store::leases::Fence;
use crate::store::runs::ConvergedTarget;
use crate::store::{self, DeviceTx, DeviceWriter, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum CommitRunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Event(#[from] EventError),
    /// A run that releases quarantined targets found none quarantined.
    #[error("none of the targets is quarantined")]
    NothingQuarantined,
    /// A plan to apply no longer describes the fleet.
    #[error("{0}")]
    PlanStale(Staleness),
}

/// The plan a run applies, checked against the fleet in the run's own
/// transaction, with the device writer held, so nothing can change between
/// the check and the commit.
#[derive(Debug)]
pub struct FromPlan {
    pub plan: Arc<Plan>,
    /// Its approval, recorded with the run.
    pub approval: Option<PlanApproval>,
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
    /// The audit record of the API call that started it, written in the
    /// run's transaction with the run id (and, for a desired change of one
    /// device, its new generation) filled in.
    pub audit: Option<AuditRecord>,
    /// Release the targets from quarantine first, in the run's
    /// transaction; the run targets only those that were quarantined.
    pub release_quarantined: bool,
    /// The plan it applies: its targets, spec and force are the plan's, and
    /// it is refused when anything the plan was computed on changed.
    pub plan: Option<FromPlan>,
    /// Its waves, for a staged rollout over the targets that need a push.
    pub rollout: Option<RolloutSpec>,
}

impl NewRun {
    /// A run over `targets` with nothing else to do: no change, no
    /// release, started by the server itself.
    pub fn new(targets: Vec<DeviceId>, trigger: Trigger) -> Self {
        Self {
            targets,
            trigger,
            force: false,
            spec: None,
            started_by: None,
            audit: None,
            release_quarantined: false,
            plan: None,
            rollout: None,
        }
    }

    /// Staged in the waves of `rollout`, if given.
    pub fn in_waves(mut self, rollout: Option<RolloutSpec>) -> Self {
        self.rollout = rollout;
        self
    }

    /// The run that applies `plan` (its devices, spec and force), with
    /// the approval it was given.
    pub fn applying(plan: Arc<Plan>, approval: Option<PlanApproval>) -> Self {
        let targets = plan.devices.iter().map(|d| d.id.clone()).collect();
        let spec = Value::clone(&plan.spec);
        let mut run = Self::new(targets, Trigger::Desired)
            .forced(plan.force)
            .changing_desired_to(spec);
        run.plan = Some(FromPlan { plan, approval });
        run
    }

    /// Push even to targets whose report already matches.
    pub fn forced(mut self, force: bool) -> Self {
        self.force = force;
        self
    }

    /// Sets `spec` as every target's desired state.
    pub fn changing_desired_to(mut self, spec: Value) -> Self {
        self.spec = Some(spec);
        self
    }

    /// Releases quarantined targets first and runs only those.
    pub fn releasing_quarantine(mut self) -> Self {
        self.release_quarantined = true;
        self
    }
}

/// How the engine's state machine sees a device (the cache plus changes
/// not yet written): the view a new run's targets are judged on.
pub type DeviceView<'a> = &'a (dyn Fn(&DeviceId) -> Option<DeviceEntry> + Sync);

/// Commits `run` (fenced by the engine lease when the engine calls it;
/// an instance without the engine commits runs unfenced, and the engine's
/// holder takes them up from the database); the engine hands the result to
/// its state machine. What the run writes is judged by the core
/// (`reconcile::creation::judge_new_run`, on the machine's `view`): targets
/// already converged get their outcome, event and any device change in
/// this same transaction; the machine carries only the rest.
pub async fn commit_run(
    writer: &DeviceWriter,
    fence: Option<&Fence>,
    event_source: &str,
    run: NewRun,
    view: DeviceView<'_>,
) -> Result<RunSpec, CommitRunError> {
    let run_id = Uuid::now_v7();
    let mut targets = run.targets;
    let mut write = writer.begin_fenced(fence).await?;
    if let Some(from) = &run.plan {
        // What its targeting matches now, read under the writer: nothing
        // registered or relabelled can slip in before the run commits.
        let now_matching: Vec<DeviceId> = match &from.plan.targeting {
            Targeting::Devices(ids) => ids.clone(),
            Targeting::Selector(labels) => {
                let labels = serde_json::to_value(labels).unwrap_or_default();
                let rows = store::devices::ids_matching_labels(&mut **write.tx(), &labels).await?;
                store::device_ids(&rows, "reading the devices a plan's selector matches")?
            }
            Targeting::All => {
                let rows =
                    store::devices::ids_matching_labels(&mut **write.tx(), &serde_json::json!({}))
                        .await?;
                store::device_ids(&rows, "reading the devices a plan covers")?
            }
        };
        plan_freshness(&from.plan, &now_matching, view).map_err(CommitRunError::PlanStale)?;
    }
    let mut released = Vec::new();
    if run.release_quarantined {
        let quarantined: HashSet<DeviceId> =
            store::devices::release_quarantine(&mut write, &targets)
                .await?
                .into_iter()
                .collect();
        targets =
            released_targets(targets, &quarantined).ok_or(CommitRunError::NothingQuarantined)?;
        released.clone_from(&targets);
    }
    let digest_and_spec = run.spec.map(|spec| (SpecDigest::of(&spec), Arc::new(spec)));
    let mut desired_changes = Vec::new();
    if let Some((digest, spec)) = &digest_and_spec {
        desired_changes =
            store::devices::set_desired(&mut write, &targets, spec, &digest.to_string()).await?;
    }
    let judged = judge_new_run(
        RunToJudge {
            id: run_id,
            trigger: run.trigger,
            force: run.force,
            started_by: run.started_by.clone(),
            targets,
            new_spec: digest_and_spec
                .as_ref()
                .map(|(digest, spec)| NewSpecDigests::new(spec, *digest)),
            new_generations: desired_changes
                .iter()
                .map(|w| (&w.id, w.generation))
                .collect(),
            rollout: run.rollout,
        },
        view,
        std::time::Instant::now(),
        chrono::Utc::now(),
    );
    let row = store::runs::NewRunRow {
        id: run_id,
        trigger: run.trigger,
        force: run.force,
        started_by: run.started_by.as_deref(),
        plan_id: run.plan.as_ref().map(|from| from.plan.id),
        approval: run.plan.as_ref().and_then(|from| from.approval.as_ref()),
    };
    write_run(&mut write, row, &judged, event_source).await?;
    if let Some(stored) = &judged.stored_rollout {
        store::runs::store_rollouts(write.tx(), &[(run_id, stored.to_json())]).await?;
    }
    if let Some(mut audit) = run.audit {
        audit.run_id = Some(run_id);
        if let ([only], None) = (desired_changes.as_slice(), audit.generation) {
            audit.generation = Some(only.generation);
        }
        store::access::record_audit(&mut **write.tx(), &audit).await?;
    }
    write.mirror(released.into_iter().map(FleetChange::Released));
    if let Some((digest, spec)) = digest_and_spec {
        let mut changes = Vec::with_capacity(desired_changes.len());
        for written in desired_changes {
            // The cache leaves out what the device owns (`set_desired`).
            let desired = DesiredState::new(written.generation, digest, spec.clone(), None);
            changes.push(FleetChange::Desired(written.id, desired));
        }
        write.mirror(changes);
    }
    for c in &judged.converged {
        if let Some(change) = &c.change {
            write.mirror([FleetChange::Engine(c.id.clone(), change.clone())]);
        }
    }
    write.commit("committing a run").await?;
    Ok(judged.spec)
}

/// Counts what committing `spec` ([`commit_run`]) committed: the run, its
/// `run.started` event, and the outcome and event of each target decided
/// `already_converged` at its creation.
pub fn count_committed(metrics: &Metrics, spec: &RunSpec) {
    let converged = spec.converged.len() as u64;
    metrics.runs_started.increment(1);
    metrics
        .outcome(OutcomeKind::AlreadyConverged)
        .increment(converged);
    metrics.events_committed.increment(converged + 1);
}

/// The run row, its targets (converged ones decided), their device changes
/// and the run's events, in the caller's transaction.
async fn write_run(
    write: &mut DeviceTx<'_>,
    row: store::runs::NewRunRow<'_>,
    judged: &JudgedRun,
    event_source: &str,
) -> Result<(), CommitRunError> {
    let carried: Vec<(DeviceId, Option<usize>, bool)> = judged
        .carried()
        .map(|c| (c.id.clone(), c.wave, c.differed))
        .collect();
    let converged: Vec<ConvergedTarget<'_>> = judged
        .converged
        .iter()
        .map(|c| ConvergedTarget {
            device_id: &c.id,
            generation: c.generation,
            health: c.health,
        })
        .collect();
    store::runs::create(write.tx(), row, &carried, &converged).await?;
    let converged_count = converged.len();
    let changes: Vec<DeviceChangeRow<'_>> = judged
        .converged
        .iter()
        .filter_map(|c| c.change.as_ref().map(|change| change_row(&c.id, change)))
        .collect();
    store::devices::apply_changes(write, &changes).await?;
    // `run.started`, then the converged targets' outcomes: those are
    // stored compactly (`events::log`) and read back as the same events.
    let tx = write.tx();
    let time = events::log::event_time(chrono::Utc::now());
    let first = store::events::reserve_sequences(tx, 1 + converged_count).await?;
    let started = events::finalize(vec![judged.started.clone()], first, event_source, time)?;
    store::events::insert(tx, &started).await?;
    events::log::append_converged(
        tx,
        judged.spec.id,
        &converged,
        first + 1,
        event_source,
        time,
    )
    .await?;
    Ok(())
}

fn change_row<'a>(id: &'a DeviceId, change: &DeviceChange) -> DeviceChangeRow<'a> {
    DeviceChangeRow {
        id: id.as_str(),
        status: change.status,
        failures: change.failures,
        ..DeviceChangeRow::default()
    }
}
