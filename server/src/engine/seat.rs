//! The engine's seat: of all the instances sharing one database, the one
//! holding the `engine` lease runs the engine (the state machine and every
//! run); the others wait for the lease.
//!
//! Holding it: the lease is renewed every third of its time to live; every
//! engine write checks it in its own transaction (`store::leases::check_fence`),
//! so an engine that lost it (paused past its lease, cut off) commits
//! nothing more. On taking the lease the engine takes up every unfinished
//! run from the database (a fresh state machine, counting on from the runs'
//! rows), and then, twice a second, every run another instance committed.
//!
//! Without it: engine commands (stored reports, connection changes) are
//! dropped — the holder learns the same from the database (its cache follows
//! the table and tells its engine); a run an API call asks for is committed
//! here, judged on the cache (up to date under the writer), and the holder
//! takes it up; an action on a rollout is answered `CarriedElsewhere`, and
//! the API asks the holder through the database (`store::rollout_actions`),
//! which the holder's seat claims and hands to its engine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::new_run::{commit_run, count_committed};
use super::{
    Carried, Engine, EngineCommand, EngineContext, EngineExit, EngineInbox, RunAnswer, RunRequest,
};
use crate::reconcile::machine::RolloutActionError;
use crate::reconcile::rollout::{Rollout, StoredRollout};
use crate::reconcile::run::{RolloutStart, RunRollout, RunSpec};
use crate::store::leases::{self, Fence, LeaseDeadline, LeaseHolder};
use crate::store::{self, DeviceWriter, StoreError};
use crate::tuning::{
    ASKED_ACTIONS_EVERY, ENGINE_LEASE_TRY_EVERY, FORGET_COMPLETED_EVERY, TAKE_UPS_CAPACITY,
    TAKE_UP_EVERY,
};

/// The lease of the one engine.
pub const ENGINE_LEASE: &str = "engine";

/// The engine's seat in this process.
pub struct EngineSeat {
    pub ctx: EngineContext,
    pub pool: PgPool,
    pub lease: LeaseHolder,
    /// Set while this instance holds the lease (`/readyz` says so).
    pub held: Arc<AtomicBool>,
    /// Reconcile the whole fleet when the lease is ours at start-up.
    pub startup_reconcile: bool,
    /// Told once the first try for the lease is done and, if it succeeded,
    /// what start-up asks of the engine is committed.
    pub settled: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    /// This process's engine inbox for rollout actions: those other
    /// instances asked for go in here while this one holds the lease.
    pub rollout_requests: mpsc::Sender<super::RolloutRequest>,
}

impl EngineSeat {
    fn settle(&self) {
        let sender = self
            .settled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(sender) = sender {
            let _ = sender.send(());
        }
    }

    /// Waits for the lease and carries the engine while it holds it, until
    /// `token` is cancelled; then the engine writes what it holds and the
    /// lease is released for the next holder.
    pub async fn run(self, mut inbox: EngineInbox, token: CancellationToken) {
        loop {
            let Some((epoch, deadline)) = self.wait_for_lease(&mut inbox, &token).await else {
                self.settle();
                return;
            };
            self.held.store(true, Ordering::Release);
            tracing::info!(
                epoch,
                "this instance holds the engine lease: it carries reconciliation"
            );
            let exit = self.carry(epoch, deadline, &mut inbox, &token).await;
            self.held.store(false, Ordering::Release);
            if token.is_cancelled() {
                if let Err(e) = leases::release(&self.pool, ENGINE_LEASE, self.lease.id).await {
                    tracing::warn!(error = %e, "could not release the engine lease; it expires after its time to live");
                }
                return;
            }
            match exit {
                EngineExit::Deposed => {
                    tracing::error!(
                        epoch,
                        "the engine lease went to another instance; this one waits for it again"
                    )
                }
                EngineExit::Stopped => {
                    tracing::error!(epoch, "the engine lease could not be renewed; this instance stopped carrying reconciliation")
                }
            }
        }
    }

    /// Serves the inbox without the lease until it is ours (`Some`: its
    /// epoch and deadline) or `token` is cancelled (`None`).
    async fn wait_for_lease(
        &self,
        inbox: &mut EngineInbox,
        token: &CancellationToken,
    ) -> Option<(i64, LeaseDeadline)> {
        loop {
            let asked = std::time::Instant::now();
            match leases::acquire_or_renew(&self.pool, ENGINE_LEASE, &self.lease).await {
                Ok(Some(held)) => {
                    return Some((held.epoch, LeaseDeadline::new(asked, self.lease.ttl)))
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "could not try the engine lease"),
            }
            // Another instance carries the engine (or the database is
            // away): this one serves the API meanwhile.
            self.settle();
            let next_try = tokio::time::sleep(ENGINE_LEASE_TRY_EVERY);
            tokio::pin!(next_try);
            loop {
                tokio::select! {
                    biased;
                    () = token.cancelled() => return None,
                    () = &mut next_try => break,
                    Some(_dropped) = inbox.commands.recv() => {
                        // The lease holder hears the same from the database.
                    }
                    Some(request) = inbox.runs.recv() => self.commit_here(request).await,
                    Some(request) = inbox.rollouts.recv() => {
                        let _ = request.reply.send(Err(RolloutActionError::CarriedElsewhere));
                    }
                }
            }
        }
    }

    /// Carries the engine under lease `epoch` until the lease is lost or
    /// `token` is cancelled.
    async fn carry(
        &self,
        epoch: i64,
        deadline: LeaseDeadline,
        inbox: &mut EngineInbox,
        token: &CancellationToken,
    ) -> EngineExit {
        let fence = Fence {
            lease: ENGINE_LEASE,
            holder_id: self.lease.id,
            epoch,
        };
        let carried = Carried::default();
        let mut engine = Engine::new(self.ctx.clone(), Some(fence), carried.clone())
            .with_deadline(deadline.clone());
        let holding = token.child_token();
        let (take_ups_tx, take_ups) = mpsc::channel(TAKE_UPS_CAPACITY);
        let renewer = tokio::spawn(renew(
            self.pool.clone(),
            self.lease.clone(),
            (epoch, deadline),
            holding.clone(),
        ));
        let answerer = tokio::spawn(answer_asked_rollout_actions(
            self.pool.clone(),
            self.lease.id,
            self.rollout_requests.clone(),
            holding.clone(),
        ));
        let finder = tokio::spawn(find_runs_to_take_up(
            self.pool.clone(),
            self.ctx.writer.clone(),
            carried,
            take_ups_tx,
            holding.clone(),
        ));
        // First the runs left unfinished (before any command queued here,
        // such as the start-up reconcile), then the retained desired
        // messages an earlier holder left behind.
        match unfinished_runs(&self.pool, &|_| false).await {
            Ok(runs) => {
                catch_up(&self.ctx.writer).await;
                for run in runs {
                    engine.take_up(run).await;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read the unfinished runs; looking again shortly")
            }
        }
        engine.handle(EngineCommand::SyncRetained).await;
        let starting = self
            .settled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some();
        if starting && self.startup_reconcile {
            // Nothing to do for an empty fleet; the engine skips it then.
            engine
                .handle(EngineCommand::ReconcileAll(
                    crate::reconcile::run::Trigger::Startup,
                ))
                .await;
        }
        self.settle();
        let exit = engine.run(inbox, take_ups, holding.clone()).await;
        holding.cancel();
        let _ = renewer.await;
        let _ = finder.await;
        let _ = answerer.await;
        exit
    }

    /// Commits a run an API call asked for while this instance does not
    /// hold the engine lease; the holder takes it up from the database.
    async fn commit_here(&self, request: RunRequest) {
        let RunRequest { run, reply, .. } = request;
        let fleet = self.ctx.fleet.clone();
        let committed = commit_run(&self.ctx.writer, None, &self.ctx.event_source, run, &|id| {
            fleet.get(id)
        })
        .await;
        match committed {
            Ok(spec) => {
                count_committed(&self.ctx.metrics, &spec);
                self.ctx.events_wake.notify_one();
                tracing::info!(run_id = %spec.id, targets = spec.targets.len(), "run committed; the engine lease holder carries it");
                let _ = reply.send(Ok(RunAnswer::created(&spec)));
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }
}

/// Renews the lease every third of its time to live; cancels `holding`
/// when it is not ours any more or could not be renewed within it.
async fn renew(
    pool: PgPool,
    lease: LeaseHolder,
    (epoch, deadline): (i64, LeaseDeadline),
    holding: CancellationToken,
) {
    let every = lease.ttl / 3;
    let mut renewed = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = holding.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let asked = std::time::Instant::now();
        match leases::acquire_or_renew(&pool, ENGINE_LEASE, &lease).await {
            Ok(Some(held)) if held.epoch == epoch => {
                renewed = tokio::time::Instant::now();
                deadline.renewed(asked, lease.ttl);
            }
            Ok(_) => {
                holding.cancel();
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not renew the engine lease; retrying");
                if renewed.elapsed() >= lease.ttl {
                    holding.cancel();
                    return;
                }
            }
        }
    }
}

/// Carries out the rollout actions other instances asked for (claimed in
/// the database, handed to this engine) and writes their answers, every
/// [`ASKED_ACTIONS_EVERY`] while `holding`.
async fn answer_asked_rollout_actions(
    pool: PgPool,
    me: Uuid,
    engine: mpsc::Sender<super::RolloutRequest>,
    holding: CancellationToken,
) {
    use crate::reconcile::machine::RolloutAction;
    use store::rollout_actions::{self as asked, ActionAnswer};
    loop {
        tokio::select! {
            () = holding.cancelled() => return,
            () = tokio::time::sleep(ASKED_ACTIONS_EVERY) => {}
        }
        let claimed = match asked::claim(&pool, me).await {
            Ok(claimed) => claimed,
            Err(e) => {
                tracing::debug!(error = %e, "could not look for rollout actions asked elsewhere");
                continue;
            }
        };
        for row in claimed {
            let action = match row.action.as_str() {
                "resume" => RolloutAction::Resume,
                "abort" => RolloutAction::Abort,
                _ => RolloutAction::Approve { by: row.by.clone() },
            };
            let (reply, answer) = tokio::sync::oneshot::channel();
            let request = super::RolloutRequest {
                run_id: row.run_id,
                action,
                reply,
            };
            if engine.send(request).await.is_err() {
                return;
            }
            let answer = match answer.await {
                Ok(Ok(stored)) => ActionAnswer::Done(stored.to_json()),
                Ok(Err(RolloutActionError::NotNow(
                    crate::reconcile::rollout::NotNow::SelfApproval,
                ))) => ActionAnswer::Refused {
                    refusal: "self_approval".to_owned(),
                    message: String::new(),
                },
                Ok(Err(RolloutActionError::NotNow(e))) => ActionAnswer::Refused {
                    refusal: "not_now".to_owned(),
                    message: e.to_string(),
                },
                Ok(Err(RolloutActionError::NotInProgress)) => ActionAnswer::Refused {
                    refusal: "not_in_progress".to_owned(),
                    message: String::new(),
                },
                // The engine stopped carrying (the lease went) before it
                // acted: the next holder claims it.
                Ok(Err(RolloutActionError::CarriedElsewhere)) | Err(_) => {
                    if let Err(e) = asked::unclaim(&pool, row.id).await {
                        tracing::warn!(error = %e, "could not hand a rollout action back");
                    }
                    return;
                }
            };
            if let Err(e) = asked::answer(&pool, row.id, &answer).await {
                tracing::warn!(error = %e, run_id = %row.run_id, "could not write the answer to a rollout action asked elsewhere");
            }
        }
    }
}

/// Hands the engine every unfinished run it does not carry: at once, then
/// every [`TAKE_UP_EVERY`].
async fn find_runs_to_take_up(
    pool: PgPool,
    writer: Arc<DeviceWriter>,
    carried: Carried,
    take_ups: mpsc::Sender<RunSpec>,
    holding: CancellationToken,
) {
    let mut looks = tokio::time::interval(TAKE_UP_EVERY);
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut forgets = tokio::time::interval(FORGET_COMPLETED_EVERY);
    forgets.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = holding.cancelled() => return,
            _ = forgets.tick() => {
                forget_completed(&pool, &carried).await;
                continue;
            }
            _ = looks.tick() => {}
        }
        let is_carried = |id: Uuid| {
            carried
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains(&id)
        };
        match unfinished_runs(&pool, &is_carried).await {
            Ok(runs) if runs.is_empty() => {}
            Ok(runs) => {
                catch_up(&writer).await;
                for run in runs {
                    if take_ups.send(run).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "could not look for runs to take up"),
        }
    }
}

/// Drops from `carried` the runs the database has as completed: a completed
/// run is never unfinished again, so it is never taken up whether carried
/// or not; without this the set grows by one id per run for as long as the
/// lease is held.
async fn forget_completed(pool: &PgPool, carried: &Carried) {
    let ids: Vec<Uuid> = carried
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .copied()
        .collect();
    match store::runs::completed_among(pool, &ids).await {
        Ok(completed) => {
            let mut carried = carried
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for id in completed {
                carried.remove(&id);
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not read which carried runs are completed"),
    }
}

/// Brings the cache up to date before runs found in the database are taken
/// up: a run committed elsewhere came with its desired change, which the
/// engine must see before it decides (never pushing an older generation).
async fn catch_up(writer: &DeviceWriter) {
    if let Err(e) = writer.follow().await {
        tracing::warn!(error = %e, "could not catch up with other instances' device writes before taking up runs");
    }
}

/// The unfinished runs not `carried`, as the state machine takes them up:
/// their undecided targets (and waves), counting on from their rows'
/// counts.
pub async fn unfinished_runs(
    pool: &PgPool,
    carried: &(dyn Fn(Uuid) -> bool + Sync),
) -> Result<Vec<RunSpec>, StoreError> {
    let mut specs = Vec::new();
    for run in store::runs::unfinished(pool).await? {
        if carried(run.id) {
            continue;
        }
        let undecided = store::runs::undecided_waves(pool, run.id).await?;
        let targets: Vec<idem_protocol::DeviceId> =
            undecided.iter().map(|(id, _, _)| id.clone()).collect();
        let differed = targets
            .iter()
            .zip(&undecided)
            .filter(|(_, (_, _, differed))| *differed)
            .map(|(id, _)| id.clone())
            .collect();
        let mut spec = RunSpec::resumed(run.id, run.trigger, run.force, run.counts(), targets)
            .with_differed(differed);
        if let Some(stored) = &run.rollout {
            let Some(rollout) = restored_rollout(run.id, &stored.0) else {
                // Nothing of it is pushed, nothing is lost: the run stays
                // `running` in the database, as it was.
                continue;
            };
            let waves = spec
                .targets
                .iter()
                .zip(&undecided)
                .filter_map(|(id, (_, wave, _))| {
                    wave.and_then(|w| usize::try_from(w).ok())
                        .map(|w| (id.clone(), w))
                })
                .collect();
            spec = spec.with_rollout(RunRollout {
                start: RolloutStart::Restored(rollout),
                waves,
            });
        }
        if u64::try_from(run.target_count).ok() != Some(spec.target_count()) {
            tracing::warn!(
                run_id = %run.id,
                target_count = run.target_count,
                decided = spec.decided.total(),
                undecided = spec.targets.len(),
                "a run's stored counts and undecided targets do not add up to its target count"
            );
        }
        specs.push(spec);
    }
    Ok(specs)
}

/// A rollout as its run row stored it, restored; `None` (logged) when the
/// row does not hold a rollout this server can carry on.
fn restored_rollout(run_id: Uuid, stored: &serde_json::Value) -> Option<Rollout> {
    let restored = serde_json::from_value::<StoredRollout>(stored.clone())
        .map_err(|e| e.to_string())
        .and_then(|stored| {
            Rollout::restore(stored, std::time::Instant::now(), chrono::Utc::now())
                .map_err(|e| e.to_string())
        });
    match restored {
        Ok(rollout) => Some(rollout),
        Err(e) => {
            tracing::error!(
                run_id = %run_id,
                error = %e,
                "not taking up a rollout whose stored state this server cannot read; \
                 its run stays running and nothing of it is pushed"
            );
            None
        }
    }
}
