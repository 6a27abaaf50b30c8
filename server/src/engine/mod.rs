//! The engine loop: feeds commands and the time into the state machine
//! (`machine`) and carries its effects out — publishes through the MQTT
//! client, commits the runs it asks for, and writes each record of
//! outcomes, device changes, attempt history and events in one
//! transaction, then mirrors the device changes in the fleet cache.
//!
//! It decides nothing itself: that is `machine`, `decide` and `policy`.

pub mod new_run;
pub mod recheck;
pub mod seat;
mod sends;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use idem_protocol::{Backoff, DeviceId};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::events::{self, EventDraft};
use crate::mqtt::Publisher;
use crate::ops::metrics::Metrics;
use crate::reconcile::machine::{Effect, Machine, Now, Record, RolloutAction, RolloutActionError};
use crate::reconcile::outcome::OutcomeCounts;
use crate::reconcile::rollout::StoredRollout;
use crate::reconcile::run::{CompletedRun, Trigger};
use crate::store::cache::{FleetCache, FleetChange};
use crate::store::devices::DeviceChangeRow;
use crate::store::leases::{Fence, LeaseDeadline};
use crate::store::{self, DeviceWriter, StoreError};
pub use new_run::CommitRunError;
use new_run::{commit_run, count_committed, NewRun};

pub use crate::reconcile::machine::{EngineCommand, EngineSettings};
use crate::tuning::ENGINE_COMMANDS_PER_BATCH;

/// Live numbers the API and metrics show.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub queued_pushes: AtomicU64,
    pub pushes_in_flight: AtomicU64,
    pub attempts_in_flight: AtomicU64,
}

/// What the engine works with, shared with the rest of the server.
#[derive(Clone)]
pub struct EngineContext {
    pub fleet: Arc<FleetCache>,
    pub metrics: Arc<Metrics>,
    pub publisher: Publisher,
    /// Woken after every commit that wrote events (the relay waits on it).
    pub events_wake: Arc<Notify>,
    pub stats: Arc<EngineStats>,
    /// CloudEvents `source`.
    pub event_source: String,
    pub settings: EngineSettings,
    pub writer: Arc<DeviceWriter>,
    /// Set while outcome writes fail (read by `/readyz`).
    pub stall: Arc<crate::ops::stall::Stall>,
}

/// A run an API call asks for. The engine creates it on its state
/// machine's view of the devices and starts it in the same step, or, for a
/// manual run identical to one still running, answers with that one.
#[derive(Debug)]
pub struct RunRequest {
    pub run: NewRun,
    /// Join a running manual run over the same targets with the same force.
    pub join_identical: bool,
    pub reply: oneshot::Sender<Result<RunAnswer, CommitRunError>>,
}

/// The engine's answer to a [`RunRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAnswer {
    pub run_id: Uuid,
    /// Every target, those decided at creation included.
    pub targets: usize,
    /// An identical manual run was still running: this is it.
    pub joined: bool,
}

impl RunAnswer {
    /// The answer for the run `spec` just committed.
    fn created(spec: &crate::reconcile::run::RunSpec) -> Self {
        Self {
            run_id: spec.id,
            targets: spec.targets.len() + spec.converged.len(),
            joined: false,
        }
    }
}

/// An operator's action on a rollout the engine carries; answered with
/// the rollout as it stands once what the action did is written.
#[derive(Debug)]
pub struct RolloutRequest {
    pub run_id: Uuid,
    pub action: RolloutAction,
    pub reply: oneshot::Sender<Result<StoredRollout, RolloutActionError>>,
}

/// What the engine receives: commands for its state machine, runs to
/// create, and operators' actions on rollouts.
#[derive(Debug)]
pub struct EngineInbox {
    pub commands: mpsc::Receiver<EngineCommand>,
    pub runs: mpsc::Receiver<RunRequest>,
    pub rollouts: mpsc::Receiver<RolloutRequest>,
}

/// Runs in the database the engine is to take up (its seat finds them).
pub type TakeUps = mpsc::Receiver<crate::reconcile::run::RunSpec>;

pub struct Engine {
    ctx: EngineContext,
    machine: Machine,
    /// Cancelled at shutdown; a write retrying against a dead database gives up then.
    shutdown: CancellationToken,
    /// The engine lease every write of this engine checks (`None`: one
    /// engine for the database, unfenced — the state machine's tests).
    fence: Option<Fence>,
    /// Until when the lease is surely ours: past it, nothing is published
    /// (`None`: unfenced).
    deadline: Option<LeaseDeadline>,
    /// A write found the lease gone: this engine stops without writing more.
    deposed: bool,
    /// Every run this engine started or took up: the runs it carries, and
    /// those it completed whose completion may not be written yet (shared
    /// with the seat, which takes up only runs not in it, and forgets those
    /// the database has as completed).
    carried: Carried,
}

/// The ids of the runs an engine started or took up.
pub type Carried = Arc<std::sync::Mutex<HashSet<Uuid>>>;

/// Why [`Engine::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineExit {
    /// Its token was cancelled (shutdown, or the lease was not renewed).
    Stopped,
    /// A write found the engine lease no longer its own.
    Deposed,
}

fn now() -> Now {
    Now {
        at: Instant::now(),
        wall: chrono::Utc::now(),
    }
}

impl Engine {
    pub fn new(ctx: EngineContext, fence: Option<Fence>, carried: Carried) -> Self {
        let machine = Machine::new(
            ctx.settings.clone(),
            ctx.fleet.clone(),
            Instant::now(),
            rand::random(),
        );
        Self {
            ctx,
            machine,
            shutdown: CancellationToken::new(),
            fence,
            deadline: None,
            deposed: false,
            carried,
        }
    }

    /// The engine with the deadline of the lease it is fenced by.
    pub fn with_deadline(mut self, deadline: LeaseDeadline) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Whether the lease may have lapsed: then this engine is deposed and
    /// carries out nothing more, since a new holder may be deciding the same
    /// devices.
    fn lease_lapsed(&mut self) -> bool {
        if self.deadline.as_ref().is_some_and(LeaseDeadline::lapsed) {
            if !self.deposed {
                tracing::error!("the engine lease may have lapsed (this process was paused or could not renew it): this engine publishes nothing more");
            }
            self.deposed = true;
        }
        self.deposed
    }

    /// Records that this engine carries run `id`; `false` if it already did.
    fn carry_run(&self, id: Uuid) -> bool {
        self.carried
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id)
    }

    /// Takes up a run another process committed or left unfinished, unless
    /// this engine carries it already.
    async fn take_up(&mut self, run: crate::reconcile::run::RunSpec) {
        if self.carried_already(run.id) {
            return;
        }
        tracing::info!(run_id = %run.id, undecided = run.targets.len(), "taking up a run");
        self.handle(EngineCommand::StartRun(run)).await;
    }

    fn carried_already(&self, id: Uuid) -> bool {
        self.carried
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&id)
    }

    /// Runs until `token` is cancelled, then writes what is pending; or
    /// until a write finds the engine lease gone, writing nothing more.
    pub async fn run(
        &mut self,
        inbox: &mut EngineInbox,
        mut take_ups: TakeUps,
        token: CancellationToken,
    ) -> EngineExit {
        let EngineInbox {
            commands,
            runs,
            rollouts,
        } = inbox;
        self.shutdown = token.clone();
        loop {
            if self.deposed {
                return EngineExit::Deposed;
            }
            let wake = self.machine.next_wake();
            tokio::select! {
                biased;
                () = token.cancelled() => break,
                command = commands.recv() => {
                    let Some(command) = command else { break };
                    self.handle(command).await;
                    let mut handled = 1;
                    while handled < ENGINE_COMMANDS_PER_BATCH {
                        let Ok(command) = commands.try_recv() else { break };
                        self.handle(command).await;
                        handled += 1;
                    }
                }
                Some(request) = runs.recv() => self.create_run(request).await,
                Some(request) = rollouts.recv() => self.act_on_rollout(request).await,
                Some(run) = take_ups.recv() => self.take_up(run).await,
                () = tokio::time::sleep_until(wake.into()) => {}
            }
            let effects = self.machine.on_tick(now());
            self.carry(effects).await;
            self.publish_stats();
        }
        if let Some(record) = self.machine.take_record(now()) {
            self.write(record).await;
        }
        if self.deposed {
            EngineExit::Deposed
        } else {
            EngineExit::Stopped
        }
    }

    async fn handle(&mut self, command: EngineCommand) {
        if let EngineCommand::StartRun(run) = &command {
            // Committed (and counted) by whoever created it; started here.
            self.carry_run(run.id);
            self.ctx.metrics.runs_started.increment(1);
        }
        let effects = self.machine.on_command(command, now());
        self.carry(effects).await;
    }

    /// Carries effects out in order. Publishes and report requests go out
    /// in runs between two writes ([`Engine::send`]); runs the machine
    /// asked for are committed after the batch, and what the machine does
    /// with them (or with devices whose publishes were withdrawn) is
    /// carried out next.
    async fn carry(&mut self, effects: Vec<Effect>) {
        let mut batches = std::collections::VecDeque::from([effects]);
        while let Some(batch) = batches.pop_front() {
            let mut withdrawn = Vec::new();
            let mut outgoing = Vec::new();
            let mut runs = Vec::new();
            for effect in batch {
                match effect {
                    Effect::Publish { .. } | Effect::AskForReport { .. } => outgoing.push(effect),
                    Effect::StartRun { trigger, targets } => runs.push((trigger, targets)),
                    Effect::Record(record) => {
                        // What came before the record leaves before it is written.
                        self.send(std::mem::take(&mut outgoing), &mut withdrawn)
                            .await;
                        self.write(record).await;
                    }
                }
            }
            self.send(outgoing, &mut withdrawn).await;
            withdrawn.sort();
            withdrawn.dedup();
            if !withdrawn.is_empty() {
                // Re-decided on the desired state they were overtaken by:
                // an attempt for the old generation ends superseded.
                let command = EngineCommand::DesiredChanged(withdrawn);
                batches.push_back(self.machine.on_command(command, now()));
            }
            for (trigger, targets) in runs {
                let command = self.start_own_run(trigger, targets).await;
                if let EngineCommand::StartRun(run) = &command {
                    self.carry_run(run.id);
                }
                batches.push_back(self.machine.on_command(command, now()));
            }
        }
    }

    /// Creates the run an API call asked for — judged on the machine's view,
    /// so no device is judged on a cache the machine is ahead of — or
    /// answers with the identical manual run still running.
    async fn create_run(&mut self, request: RunRequest) {
        let RunRequest {
            run,
            join_identical,
            reply,
        } = request;
        if join_identical {
            if let Some(run_id) = self.machine.identical_manual_run(&run.targets, run.force) {
                let _ = reply.send(Ok(RunAnswer {
                    run_id,
                    targets: run.targets.len(),
                    joined: true,
                }));
                return;
            }
        }
        let machine = &self.machine;
        let committed = commit_run(
            &self.ctx.writer,
            self.fence.as_ref(),
            &self.ctx.event_source,
            run,
            &|id| machine.view(id),
        )
        .await;
        match committed {
            Ok(spec) => {
                self.ctx.events_wake.notify_one();
                count_committed(&self.ctx.metrics, &spec);
                let answer = RunAnswer::created(&spec);
                self.carry_run(spec.id);
                let command = EngineCommand::StartRun(spec);
                let effects = self.machine.on_command(command, now());
                // The caller may have gone (its connection closed): the run
                // is committed and goes on regardless.
                let _ = reply.send(Ok(answer));
                self.carry(effects).await;
            }
            Err(e) => {
                self.deposed |= lease_lost(&e);
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Carries out an operator's action on a rollout; the answer follows
    /// the write of what it did.
    async fn act_on_rollout(&mut self, request: RolloutRequest) {
        let RolloutRequest {
            run_id,
            action,
            reply,
        } = request;
        match self.machine.act_on_rollout(run_id, action, now()) {
            Ok((effects, stored)) => {
                self.carry(effects).await;
                let _ = reply.send(Ok(stored));
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Commits a run the engine starts itself; if the commit fails
    /// (database down), the machine tries again a debounce window later.
    async fn start_own_run(&mut self, trigger: Trigger, targets: Vec<DeviceId>) -> EngineCommand {
        let run = NewRun::new(targets.clone(), trigger);
        let machine = &self.machine;
        let committed = commit_run(
            &self.ctx.writer,
            self.fence.as_ref(),
            &self.ctx.event_source,
            run,
            &|id| machine.view(id),
        )
        .await;
        match committed {
            Ok(run) => {
                self.ctx.events_wake.notify_one();
                count_committed(&self.ctx.metrics, &run);
                tracing::info!(run_id = %run.id, trigger = run.trigger.as_str(), targets = run.targets.len(), "run started");
                EngineCommand::StartRun(run)
            }
            Err(e) => {
                self.deposed |= lease_lost(&e);
                tracing::error!(error = %e, trigger = trigger.as_str(), "could not start a run; will retry");
                EngineCommand::RunNotStarted { trigger, targets }
            }
        }
    }

    fn publish_stats(&self) {
        let stats = self.machine.stats();
        let as_u64 = |n: usize| n as u64;
        let shared = &self.ctx.stats;
        shared
            .queued_pushes
            .store(as_u64(stats.queued_pushes), Ordering::Relaxed);
        shared
            .pushes_in_flight
            .store(as_u64(stats.pushes_in_flight), Ordering::Relaxed);
        shared
            .attempts_in_flight
            .store(as_u64(stats.attempts_in_flight), Ordering::Relaxed);
        let metrics = &self.ctx.metrics;
        metrics.push_queue_depth.set(stats.queued_pushes as f64);
        metrics.pushes_in_flight.set(stats.pushes_in_flight as f64);
        metrics
            .attempts_in_flight
            .set(stats.attempts_in_flight as f64);
        metrics.set_rollouts(&stats.rollouts);
    }

    /// Writes `record` in one transaction, retrying until it commits or the
    /// engine is cancelled; then mirrors it in the cache and the metrics.
    async fn write(&mut self, mut record: Record) {
        let token = self.shutdown.clone();
        let mut backoff = Backoff::store_and_broker();
        loop {
            let started = Instant::now();
            self.ctx.stall.writing();
            match self.try_write(&record).await {
                Ok(committed) => {
                    self.ctx.stall.progressed();
                    self.ctx
                        .metrics
                        .db_batch_outcomes
                        .record(started.elapsed().as_secs_f64());
                    record.devices.clear();
                    self.after_commit(&record, committed);
                    self.machine.record_written(Instant::now());
                    return;
                }
                Err(WriteError::Store(StoreError::LeaseLost { lease, epoch })) => {
                    tracing::error!(
                        lease,
                        epoch,
                        outcomes = record.outcomes.len(),
                        "another instance holds the engine lease now; this engine stops and writes \
                         nothing more (the new holder decides what this write held)"
                    );
                    self.deposed = true;
                    return;
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::error!(error = %e, "writing outcomes failed; retrying in {delay:?}");
                    tokio::select! {
                        () = token.cancelled() => {
                            tracing::error!(
                                "shutting down with {} unwritten outcomes; their runs resume at next start",
                                record.outcomes.len()
                            );
                            return;
                        }
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    async fn try_write(&self, record: &Record) -> Result<Committed, WriteError> {
        let mut write = self.ctx.writer.begin_fenced(self.fence.as_ref()).await?;
        let devices: Vec<DeviceChangeRow<'_>> = record
            .devices
            .iter()
            .map(|(id, c)| DeviceChangeRow {
                id: id.as_str(),
                status: c.status,
                failures: c.failures,
                last_error: c.last_error.as_deref(),
                last_outcome: c
                    .last_outcome
                    .as_ref()
                    .map(|o| (o.run_id, o.kind, o.reason.as_deref())),
                retained_generation: c.retained,
            })
            .collect();
        store::devices::apply_changes(&mut write, &devices).await?;
        store::devices::record_attempts(&mut write, &record.attempts).await?;
        let tx = write.tx();
        let per_run: Vec<(Uuid, OutcomeCounts)> =
            record.per_run.iter().map(|(k, v)| (*k, *v)).collect();
        store::runs::record_outcomes(tx, &record.outcomes, &per_run).await?;
        let rollouts: Vec<(Uuid, serde_json::Value)> = record
            .rollouts
            .iter()
            .map(|(id, stored)| (*id, stored.to_json()))
            .collect();
        store::runs::store_rollouts(tx, &rollouts).await?;
        let ids: Vec<Uuid> = record.completed.iter().map(|run| run.id).collect();
        // Only the runs this write completed are announced: one another
        // writer completed already was announced by it.
        let completed = store::runs::complete(tx, &ids).await?;
        if cfg!(debug_assertions) {
            assert_stored_counts_agree(tx, record, &completed).await?;
        }
        let mut drafts: Vec<EventDraft> = record.drafts.clone();
        drafts.extend(announced(record, &completed).map(CompletedRun::event));
        let first = store::events::reserve_sequences(tx, drafts.len()).await?;
        let rows = events::finalize(drafts, first, &self.ctx.event_source, chrono::Utc::now())?;
        store::events::insert(tx, &rows).await?;
        write.mirror(
            record
                .devices
                .iter()
                .map(|(id, change)| FleetChange::Engine(id.clone(), change.clone())),
        );
        write.commit("committing outcomes").await?;
        Ok(Committed {
            completed,
            events: rows.len(),
        })
    }

    fn after_commit(&self, record: &Record, committed: Committed) {
        let metrics = &self.ctx.metrics;
        for row in &record.outcomes {
            metrics.outcome(row.kind).increment(1);
        }
        for latency in &record.tally.convergence {
            metrics.convergence_latency.record(latency.as_secs_f64());
        }
        metrics.retries.increment(record.tally.retries);
        metrics.quarantined.increment(record.tally.quarantines);
        metrics.drifts.increment(record.tally.drifts);
        for draft in &record.drafts {
            metrics.rollout_step(draft.event_type.as_str());
        }
        for run in announced(record, &committed.completed) {
            metrics.run_duration.record(run.elapsed.as_secs_f64());
            metrics.runs_completed.increment(1);
            metrics.set_last_run(&run.counts);
            tracing::info!(
                run_id = %run.id,
                trigger = run.trigger.as_str(),
                elapsed_ms = run.elapsed.as_millis() as u64,
                "run completed: {}",
                run.counts.summary()
            );
        }
        if committed.events > 0 {
            metrics.events_committed.increment(committed.events as u64);
            self.ctx.events_wake.notify_one();
        }
    }
}

/// The engine lease was gone when a run was to be committed.
fn lease_lost(e: &CommitRunError) -> bool {
    matches!(e, CommitRunError::Store(StoreError::LeaseLost { .. }))
}

struct Committed {
    /// The runs the write marked completed.
    completed: Vec<Uuid>,
    events: usize,
}

/// The machine's ends of the runs the write marked completed (`completed`).
fn announced<'a>(
    record: &'a Record,
    completed: &'a [Uuid],
) -> impl Iterator<Item = &'a CompletedRun> {
    record
        .completed
        .iter()
        .filter(|run| completed.contains(&run.id))
}

/// Debug builds: the run rows' counts, added up by
/// `store::runs::record_outcomes`, are the machine's that the write
/// announces.
async fn assert_stored_counts_agree(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    record: &Record,
    completed: &[Uuid],
) -> Result<(), StoreError> {
    for row in store::runs::get_many_in(tx, completed).await? {
        if let Some(run) = record.completed.iter().find(|run| run.id == row.id) {
            let stored = (u64::try_from(row.target_count).ok(), row.counts());
            assert_eq!(
                stored,
                (Some(run.target_count), run.counts),
                "run {}: the stored (target count, counts) differ from the machine's",
                run.id
            );
        }
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Event(#[from] events::EventError),
}
