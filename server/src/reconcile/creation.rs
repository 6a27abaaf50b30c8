//! Judging a new run as it is created: whether the plan it applies still
//! describes the fleet, which targets a quarantine release keeps, which
//! targets are already converged (their outcome, event and row change),
//! which the engine carries (their wave, whether their report differed),
//! the run's first events and its rollout's first stored state. Pure:
//! `engine/new_run.rs` reads the rows, calls this and writes what it
//! returns.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use chrono::{DateTime, Utc};
use idem_protocol::event::RunStartedData;
use idem_protocol::{DeviceId, Generation};
use uuid::Uuid;

use super::device::DeviceEntry;
use super::event_draft::EventDraft;
use super::owned::NewSpecDigests;
use super::plan::{retargeted, Plan, Staleness};
use super::policy::{converged_targets, Converged};
use super::rollout::{assign_waves, Rollout, RolloutSpec, StoredRollout};
use super::run::{RolloutStart, RunRollout, RunSpec, Trigger};

/// Whether `plan` still describes the fleet: the devices it was computed
/// on are as they were in `view`, and its targeting matches `now_matching`
/// (read when the run is created), no device more and none fewer.
pub fn plan_freshness(
    plan: &Plan,
    now_matching: &[DeviceId],
    view: impl Fn(&DeviceId) -> Option<DeviceEntry>,
) -> Result<(), Staleness> {
    let (joined, left) = retargeted(plan, now_matching, |id| view(id).is_some());
    let mut staleness = Staleness {
        joined,
        left,
        ..Staleness::default()
    };
    staleness.compare(&plan.devices, &view);
    if staleness.is_fresh() {
        Ok(())
    } else {
        Err(staleness)
    }
}

/// The targets of a run that releases quarantine: those of `targets` the
/// release found `quarantined`, in their order (`None`: none was).
pub fn released_targets(
    targets: Vec<DeviceId>,
    quarantined: &HashSet<DeviceId>,
) -> Option<Vec<DeviceId>> {
    let kept: Vec<DeviceId> = targets
        .into_iter()
        .filter(|id| quarantined.contains(id))
        .collect();
    (!kept.is_empty()).then_some(kept)
}

/// A run about to be created, judged on the rows after the desired change
/// it makes was written (`new_generations`).
#[derive(Debug)]
pub struct RunToJudge<'a> {
    pub id: Uuid,
    pub trigger: Trigger,
    pub force: bool,
    /// The operator token that started it (`None`: the server itself).
    pub started_by: Option<String>,
    /// Distinct (the API and the engine's own runs deduplicate).
    pub targets: Vec<DeviceId>,
    /// The desired spec the run sets on every target, if it changes one.
    pub new_spec: Option<NewSpecDigests<'a>>,
    /// The desired generation that change gave each target whose spec it
    /// changed.
    pub new_generations: HashMap<&'a DeviceId, Generation>,
    pub rollout: Option<RolloutSpec>,
}

/// A target the engine carries: it needs deciding after the run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    pub id: DeviceId,
    /// Its wave, in a staged rollout.
    pub wave: Option<usize>,
    /// It had a report that was not its desired spec (found converged later
    /// in the run, it was provisioned by it).
    pub differed: bool,
}

/// What creating a run writes, and the run the engine then carries.
#[derive(Debug)]
pub struct JudgedRun {
    /// The targets decided `already_converged` now, with their row change;
    /// each one's outcome event is `EventDraft::already_converged`, its
    /// sequence after `run.started`'s in this order.
    pub converged: Vec<Converged>,
    /// `run.started`: the run's first event, before its converged targets'.
    pub started: EventDraft,
    /// The rollout's state until the engine's first write of it.
    pub stored_rollout: Option<StoredRollout>,
    /// The run as the engine's state machine starts it.
    pub spec: RunSpec,
}

impl JudgedRun {
    /// The targets left for the engine, in target order, each with its wave
    /// and whether it differed (read from the run the machine starts).
    pub fn carried(&self) -> impl Iterator<Item = Carried> + '_ {
        let waves = self.spec.rollout.as_ref().map(|rollout| &rollout.waves);
        self.spec.targets.iter().map(move |id| Carried {
            id: id.clone(),
            wave: waves.and_then(|w| w.get(id).copied()),
            differed: self.spec.differed.contains(id),
        })
    }
}

/// Judges `run` on `view` (the engine's state machine's view of each
/// device, or the cache on an instance without the engine) at `now`
/// (`wall` on the wall clock, for the stored rollout).
pub fn judge_new_run(
    run: RunToJudge<'_>,
    view: impl Fn(&DeviceId) -> Option<DeviceEntry>,
    now: Instant,
    wall: DateTime<Utc>,
) -> JudgedRun {
    let RunToJudge {
        id,
        trigger,
        force,
        started_by,
        targets,
        mut new_spec,
        new_generations,
        rollout,
    } = run;
    let converged = converged_targets(&view, &targets, force, new_spec.as_mut(), &new_generations);
    let decided: HashSet<&DeviceId> = converged.iter().map(|c| &c.id).collect();
    let undecided: Vec<DeviceId> = targets
        .iter()
        .filter(|id| !decided.contains(id))
        .cloned()
        .collect();
    let waves = rollout.as_ref().map(|spec| assign_waves(spec, &undecided));
    let differed: HashSet<DeviceId> = undecided
        .iter()
        .filter(|id| view(id).is_some_and(|entry| entry.reported.is_some()))
        .cloned()
        .collect();
    let started = EventDraft::run_started(
        id,
        RunStartedData {
            trigger,
            target_count: targets.len() as u64,
            force,
            started_by: started_by.clone(),
        },
    );
    let (stored_rollout, run_rollout) = match (rollout, waves) {
        (Some(spec), Some(waves)) => {
            // Its state until the engine's first write: the start the
            // engine makes of it (the same steps, without their events).
            let (begun, _) =
                Rollout::start(spec.clone(), undecided.len() as u64, started_by.clone());
            let stored = begun.stored(now, wall);
            let start = RolloutStart::New {
                spec,
                author: started_by,
            };
            (Some(stored), Some(RunRollout { start, waves }))
        }
        (Some(_), None) | (None, _) => (None, None),
    };
    let converged_ids = converged.iter().map(|c| c.id.clone()).collect();
    let spec =
        RunSpec::created(id, trigger, force, undecided, converged_ids).with_differed(differed);
    let spec = match run_rollout {
        Some(rollout) => spec.with_rollout(rollout),
        None => spec,
    };
    JudgedRun {
        converged,
        started,
        stored_rollout,
        spec,
    }
}

#[cfg(test)]
mod tests;
