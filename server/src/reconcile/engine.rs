//! The run engine: one task that owns every in-flight attempt, feeds facts to
//! `decide`, carries out its decisions (push, ask, finish) and writes outcomes,
//! run counts and events in one transaction per batch.
//!
//! It never decides anything itself: all judgement is in `decide`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_protocol::DeviceId;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::{broadcast, mpsc, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::decide::{decide, Attempt, Decision};
use super::outcome::{Outcome, OutcomeCounts, SkipReason};
use crate::events::{self, EventDraft, EventType};
use crate::fleet::{DeviceEntry, Fleet};
use crate::metrics::Metrics;
use crate::mqtt::Publisher;
use crate::store::{self, runs::OutcomeRow, StoreError};

/// Most device outcomes listed in a `run.completed` event; the full list
/// stays queryable through the API.
pub const COMPLETED_EVENT_OUTCOME_CAP: usize = 1_000;

/// How often in-flight attempts are checked against their deadline.
const DEADLINE_TICK: Duration = Duration::from_millis(50);

/// Most commands handled before their results are written.
const MAX_COMMANDS_PER_BATCH: usize = 256;

#[derive(Debug)]
pub enum EngineCommand {
    /// A run was committed with these targets; `decided` of its targets
    /// already have outcomes (a run resumed after a restart).
    StartRun {
        run_id: Uuid,
        trigger: String,
        targets: Vec<DeviceId>,
        force: bool,
        decided: usize,
    },
    /// These devices' reports were committed and are in the fleet cache.
    ReportsApplied(Vec<DeviceId>),
}

/// What the engine tells the world after a commit.
#[derive(Debug, Clone)]
pub enum EngineNotice {
    RunCompleted { run_id: Uuid, counts: OutcomeCounts },
}

struct RunProgress {
    trigger: String,
    remaining: usize,
    started: Instant,
    /// Device → outcome, capped at [`COMPLETED_EVENT_OUTCOME_CAP`].
    sample: BTreeMap<String, &'static str>,
    sample_truncated: bool,
}

struct InFlight {
    runs: Vec<Uuid>,
    attempt: Attempt,
    deadline: Instant,
    /// When the run that started this attempt began: convergence latency
    /// is measured from there.
    since: Instant,
}

/// Results of handled commands waiting to be written together.
#[derive(Default)]
struct Pending {
    outcomes: Vec<OutcomeRow>,
    drafts: Vec<EventDraft>,
    per_run: HashMap<Uuid, OutcomeCounts>,
    provisioning: Vec<String>,
    completed: Vec<Uuid>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.outcomes.is_empty() && self.provisioning.is_empty() && self.completed.is_empty()
    }
}

/// What the engine works with, shared with the rest of the server.
pub struct EngineContext {
    pub pool: PgPool,
    pub fleet: Arc<Fleet>,
    pub metrics: Arc<Metrics>,
    pub publisher: Publisher,
    pub notices: broadcast::Sender<EngineNotice>,
    /// Woken after every commit that wrote events (the relay waits on it).
    pub events_wake: Arc<Notify>,
    pub push_timeout: Duration,
    /// CloudEvents `source`.
    pub event_source: String,
}

pub struct Engine {
    ctx: EngineContext,
    runs: HashMap<Uuid, RunProgress>,
    in_flight: HashMap<DeviceId, InFlight>,
    pending: Pending,
}

impl Engine {
    pub fn new(ctx: EngineContext) -> Self {
        Self {
            ctx,
            runs: HashMap::new(),
            in_flight: HashMap::new(),
            pending: Pending::default(),
        }
    }

    /// Runs until `token` is cancelled, then writes what is pending.
    pub async fn run(
        mut self,
        mut commands: mpsc::Receiver<EngineCommand>,
        token: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(DEADLINE_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = token.cancelled() => break,
                command = commands.recv() => {
                    let Some(command) = command else { break };
                    self.handle(command).await;
                    let mut handled = 1;
                    while handled < MAX_COMMANDS_PER_BATCH {
                        let Ok(command) = commands.try_recv() else { break };
                        self.handle(command).await;
                        handled += 1;
                    }
                }
                _ = tick.tick() => self.expire_deadlines().await,
            }
            self.flush(&token).await;
        }
        self.flush(&token).await;
    }

    async fn handle(&mut self, command: EngineCommand) {
        match command {
            EngineCommand::StartRun {
                run_id,
                trigger,
                targets,
                force,
                decided,
            } => {
                self.start_run(run_id, trigger, targets, force, decided)
                    .await;
            }
            EngineCommand::ReportsApplied(ids) => {
                for id in ids {
                    if self.in_flight.contains_key(&id) {
                        self.advance(&id).await;
                    }
                }
            }
        }
    }

    async fn start_run(
        &mut self,
        run_id: Uuid,
        trigger: String,
        targets: Vec<DeviceId>,
        force: bool,
        decided: usize,
    ) {
        let now = Instant::now();
        self.ctx.metrics.runs_started.increment(1);
        self.runs.insert(
            run_id,
            RunProgress {
                trigger,
                remaining: targets.len(),
                started: now,
                sample: BTreeMap::new(),
                sample_truncated: decided > 0,
            },
        );
        if targets.is_empty() {
            self.pending.completed.push(run_id);
            return;
        }
        for id in targets {
            if self.join_attempt_in_flight(&id, run_id).await {
                continue;
            }
            self.in_flight.insert(
                id.clone(),
                InFlight {
                    runs: vec![run_id],
                    attempt: Attempt::Fresh { force },
                    deadline: now + self.ctx.push_timeout,
                    since: now,
                },
            );
            self.advance(&id).await;
        }
        self.ctx
            .metrics
            .attempts_in_flight
            .set(self.in_flight.len() as f64);
    }

    /// Lets `run_id` share the attempt already in flight for `id`, when there
    /// is one for the current desired generation. A push of an older
    /// generation ends `Superseded` first and the run starts afresh.
    async fn join_attempt_in_flight(&mut self, id: &DeviceId, run_id: Uuid) -> bool {
        let Some(flight) = self.in_flight.get_mut(id) else {
            return false;
        };
        let current = self
            .ctx
            .fleet
            .get(id)
            .and_then(|e| e.desired.map(|d| d.generation));
        match flight.attempt {
            Attempt::Pushed { generation, .. } if Some(generation) != current => {
                let entry = self.ctx.fleet.get(id).unwrap_or_default();
                self.finish(id, Outcome::Superseded, &entry);
                false
            }
            Attempt::Fresh { .. } | Attempt::AwaitingReport { .. } | Attempt::Pushed { .. } => {
                flight.runs.push(run_id);
                true
            }
        }
    }

    /// Decides for one in-flight device and carries the decision out.
    async fn advance(&mut self, id: &DeviceId) {
        let entry = self.ctx.fleet.get(id).unwrap_or_default();
        let Some(desired) = entry.desired_for_decision() else {
            self.finish(id, Outcome::Skipped(SkipReason::NoDesiredSpec), &entry);
            return;
        };
        let Some(flight) = self.in_flight.get_mut(id) else {
            return;
        };
        match decide(&desired, &entry.actual(), &flight.attempt) {
            Decision::Finish(outcome) => self.finish(id, outcome, &entry),
            Decision::Push => {
                flight.attempt = Attempt::Pushed {
                    generation: desired.generation,
                    seq_at_push: entry.reported_seq(),
                    expired: false,
                };
                flight.deadline = Instant::now() + self.ctx.push_timeout;
                self.pending.provisioning.push(id.to_string());
                if let Some(state) = &entry.desired {
                    self.ctx
                        .publisher
                        .push(id, state.generation, &state.spec)
                        .await;
                    self.ctx.metrics.pushes.increment(1);
                }
            }
            Decision::AskForReport => {
                flight.attempt = Attempt::AwaitingReport { expired: false };
                flight.deadline = Instant::now() + self.ctx.push_timeout;
                self.ctx.publisher.ask_for_report(id).await;
                self.ctx.metrics.report_requests.increment(1);
            }
            Decision::Wait => {}
        }
    }

    async fn expire_deadlines(&mut self) {
        let now = Instant::now();
        let expired: Vec<DeviceId> = self
            .in_flight
            .iter_mut()
            .filter(|(_, f)| f.deadline <= now)
            .filter_map(|(id, f)| {
                let marked = match &mut f.attempt {
                    Attempt::Fresh { .. } => false,
                    Attempt::AwaitingReport { expired } | Attempt::Pushed { expired, .. } => {
                        *expired = true;
                        true
                    }
                };
                marked.then(|| id.clone())
            })
            .collect();
        for id in expired {
            self.advance(&id).await;
        }
    }

    /// Records `outcome` for every run waiting on this device's attempt.
    fn finish(&mut self, id: &DeviceId, outcome: Outcome, entry: &DeviceEntry) {
        let Some(flight) = self.in_flight.remove(id) else {
            return;
        };
        let kind = outcome.kind();
        let status = status_after(&outcome);
        let reason = outcome.reason();
        let generation = entry.desired.as_ref().map(|d| d.generation);
        let health = entry.health.map(|h| h.as_str().to_owned());
        match &outcome {
            Outcome::Provisioned => self
                .ctx
                .metrics
                .convergence_latency
                .record(flight.since.elapsed().as_secs_f64()),
            Outcome::AlreadyConverged
            | Outcome::Failed(_)
            | Outcome::Skipped(_)
            | Outcome::Superseded => {}
        }
        for run_id in flight.runs {
            self.ctx.metrics.outcome(kind).increment(1);
            self.pending.outcomes.push(OutcomeRow {
                run_id,
                device_id: id.to_string(),
                outcome: kind.as_str(),
                reason: reason.clone(),
                generation,
                health: health.clone(),
                status,
            });
            self.pending.drafts.push(EventDraft {
                event_type: EventType::Device(kind),
                subject: id.to_string(),
                run_id: Some(run_id),
                generation,
                data: json!({
                    "outcome": kind.as_str(),
                    "reason": reason,
                    "health": health,
                    "success": outcome.is_success(),
                }),
            });
            self.pending.per_run.entry(run_id).or_default().add(kind);
            if let Some(run) = self.runs.get_mut(&run_id) {
                run.remaining = run.remaining.saturating_sub(1);
                if run.sample.len() < COMPLETED_EVENT_OUTCOME_CAP {
                    run.sample.insert(id.to_string(), kind.as_str());
                } else {
                    run.sample_truncated = true;
                }
                if run.remaining == 0 {
                    self.pending.completed.push(run_id);
                }
            }
        }
        self.ctx
            .metrics
            .attempts_in_flight
            .set(self.in_flight.len() as f64);
    }

    /// Writes pending results in one transaction, retrying until it commits
    /// or the engine is cancelled.
    async fn flush(&mut self, token: &CancellationToken) {
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let mut backoff = Duration::from_millis(100);
        loop {
            let started = Instant::now();
            match self.write(&pending).await {
                Ok(committed) => {
                    self.ctx
                        .metrics
                        .db_batch_outcomes
                        .record(started.elapsed().as_secs_f64());
                    self.after_commit(committed);
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, "writing outcomes failed; retrying in {backoff:?}");
                    tokio::select! {
                        () = token.cancelled() => {
                            tracing::error!("shutting down with {} unwritten outcomes", pending.outcomes.len());
                            return;
                        }
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn write(&self, pending: &Pending) -> Result<Committed, FlushError> {
        let mut tx = self.ctx.pool.begin().await.map_err(|e| StoreError::Db {
            context: "starting a transaction",
            source: e,
        })?;
        let per_run: Vec<(Uuid, OutcomeCounts)> =
            pending.per_run.iter().map(|(k, v)| (*k, *v)).collect();
        store::runs::record_outcomes(&mut tx, &pending.outcomes, &per_run).await?;
        store::devices::set_status(&mut tx, &pending.provisioning, "provisioning").await?;
        let completed = store::runs::complete(&mut tx, &pending.completed).await?;
        let mut drafts = pending.drafts.clone();
        for run in &completed {
            let counts = run.counts();
            let progress = self.runs.get(&run.id);
            drafts.push(EventDraft {
                event_type: EventType::RunCompleted,
                subject: run.id.to_string(),
                run_id: Some(run.id),
                generation: None,
                data: json!({
                    "trigger": run.trigger,
                    "target_count": run.target_count,
                    "counts": counts,
                    "summary": counts.summary(),
                    "duration_ms": progress.map(|p| p.started.elapsed().as_millis() as u64),
                    "outcomes": progress.map(|p| &p.sample),
                    "outcomes_truncated": progress.is_none_or(|p| p.sample_truncated),
                }),
            });
        }
        let first = store::events::reserve_sequences(&mut tx, drafts.len()).await?;
        let rows = events::finalize(drafts, first, &self.ctx.event_source, chrono::Utc::now())?;
        store::events::insert(&mut tx, &rows).await?;
        tx.commit().await.map_err(|e| StoreError::Db {
            context: "committing outcomes",
            source: e,
        })?;
        Ok(Committed {
            completed: completed.into_iter().map(|r| (r.id, r.counts())).collect(),
            events: rows.len(),
        })
    }

    fn after_commit(&mut self, committed: Committed) {
        for (run_id, counts) in committed.completed {
            let progress = self.runs.remove(&run_id);
            if let Some(p) = &progress {
                self.ctx
                    .metrics
                    .run_duration
                    .record(p.started.elapsed().as_secs_f64());
            }
            self.ctx.metrics.runs_completed.increment(1);
            self.ctx.metrics.set_last_run(&counts);
            tracing::info!(
                %run_id,
                trigger = progress.as_ref().map(|p| p.trigger.as_str()).unwrap_or("resumed"),
                elapsed_ms = progress.as_ref().map(|p| p.started.elapsed().as_millis() as u64),
                "run completed: {}",
                counts.summary()
            );
            let _ = self
                .ctx
                .notices
                .send(EngineNotice::RunCompleted { run_id, counts });
        }
        if committed.events > 0 {
            self.ctx
                .metrics
                .events_committed
                .increment(committed.events as u64);
            self.ctx.events_wake.notify_one();
        }
    }
}

struct Committed {
    completed: Vec<(Uuid, OutcomeCounts)>,
    events: usize,
}

#[derive(Debug, thiserror::Error)]
enum FlushError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Event(#[from] events::EventError),
}

/// The device status an outcome leaves behind (`None` keeps the current one).
fn status_after(outcome: &Outcome) -> Option<&'static str> {
    match outcome {
        Outcome::Provisioned | Outcome::AlreadyConverged => Some("converged"),
        Outcome::Failed(_) => Some("failed"),
        Outcome::Skipped(SkipReason::Offline) => Some("offline"),
        Outcome::Skipped(SkipReason::Quarantined) => Some("quarantined"),
        Outcome::Skipped(SkipReason::NoDesiredSpec) | Outcome::Superseded => None,
    }
}
