//! The run engine: one task that owns every in-flight attempt, feeds facts to
//! `decide`, carries out its decisions (push, ask, finish), retries failures
//! with backoff, paces pushes, starts its own runs (start-up, resync, drift,
//! reconnect) and writes outcomes, run counts, attempt history and events in
//! one transaction per batch.
//!
//! It never judges a device itself: that is `decide` and `policy`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_protocol::DeviceId;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::{broadcast, mpsc, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::decide::{decide, Attempt, Decision};
use super::outcome::{Outcome, OutcomeCounts};
use super::policy::{gate, status_after, AfterFailure, DeviceStatus, RetryPolicy};
use super::runs::{commit_run, NewRun, Trigger};
use crate::events::{self, EventDraft, EventType};
use crate::fleet::{DeviceEntry, Fleet};
use crate::metrics::Metrics;
use crate::mqtt::Publisher;
use crate::store::devices::AttemptRow;
use crate::store::{self, runs::OutcomeRow, DeviceWrites, StoreError};

/// Most device outcomes listed in a `run.completed` event; the full list
/// stays queryable through the API.
pub const COMPLETED_EVENT_OUTCOME_CAP: usize = 1_000;

/// How often in-flight attempts are checked against deadlines and retry times.
const SCAN_INTERVAL: Duration = Duration::from_millis(50);
/// Results are written at least this often while there are any.
const FLUSH_INTERVAL: Duration = Duration::from_millis(20);
/// Write at once when this many outcomes are waiting.
const FLUSH_SIZE: usize = 10_000;
/// Most commands handled before their results are written.
const MAX_COMMANDS_PER_BATCH: usize = 256;
/// Pacing headroom: pushes are spaced `1.1 s / rate` apart and at most
/// `rate` leave in any 1.1 s, so that delivery jitter of up to 100 ms between
/// server and devices never shows more than `rate` in a one-second window.
/// The price: a sustained push stream runs at about 91 % of the limit.
const PACING_WINDOW: Duration = Duration::from_millis(1_100);
/// A late wake-up (e.g. after a database write) may catch up on at most this
/// much pacing time at once; the sliding window still bounds any burst.
const PACING_CATCH_UP: Duration = Duration::from_millis(10);

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
    /// These devices' connection state changed (committed, in the cache).
    Connectivity(Vec<(DeviceId, bool)>),
    /// Start a run over every device that has desired state.
    ReconcileAll(Trigger),
    /// These devices' desired state changed without a run (registration
    /// with a spec): their retained desired message must follow.
    DesiredChanged(Vec<DeviceId>),
    /// These devices were deleted (committed, gone from the cache): their
    /// attempts end `skipped`, nothing more is published to them.
    DevicesRemoved(Vec<DeviceId>),
    /// Refresh every retained desired message that is behind (start-up).
    SyncRetained,
}

/// What the engine tells the world after a commit.
#[derive(Debug, Clone)]
pub enum EngineNotice {
    RunCompleted { run_id: Uuid, counts: OutcomeCounts },
}

/// Engine tunables (from the configuration).
#[derive(Debug, Clone)]
pub struct EngineSettings {
    pub push_timeout: Duration,
    pub retry: RetryPolicy,
    /// Pushes per second; `None` = unlimited.
    pub push_rate: Option<u32>,
    /// Pushes awaiting confirmation at once.
    pub max_in_flight: usize,
    /// Drift and reconnect triggers within this window make one run.
    pub debounce: Duration,
    /// Periodic full re-check; `None` = off.
    pub resync_interval: Option<Duration>,
    /// At resync, devices whose last report is older than this are asked for a new one.
    pub stale_after: Duration,
}

/// Live numbers the API and metrics show.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub queued_pushes: AtomicU64,
    pub pushes_in_flight: AtomicU64,
    pub attempts_in_flight: AtomicU64,
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
    pub stats: Arc<EngineStats>,
    /// CloudEvents `source`.
    pub event_source: String,
    pub settings: EngineSettings,
    pub device_writes: DeviceWrites,
    /// Set while outcome writes fail (read by `/readyz`).
    pub stall: Arc<crate::stall::Stall>,
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
    force: bool,
    attempt: Attempt,
    /// Desired generation this attempt works towards.
    generation: Option<u64>,
    /// When the current push or report request expires.
    deadline: Option<Instant>,
    /// A failed attempt waits until then before it is retried.
    retry_at: Option<Instant>,
    /// Waiting in the push queue.
    queued: bool,
    /// When the run that started this attempt began (convergence latency).
    since: Instant,
}

/// Results waiting to be written together.
#[derive(Default)]
struct Pending {
    outcomes: Vec<OutcomeRow>,
    drafts: Vec<EventDraft>,
    per_run: HashMap<Uuid, OutcomeCounts>,
    statuses: Vec<(String, DeviceStatus)>,
    attempts: Vec<AttemptRow>,
    resets: Vec<String>,
    completed: Vec<Uuid>,
    /// Retained desired generations handed to the broker.
    retained: Vec<(String, u64)>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
            && self.drafts.is_empty()
            && self.statuses.is_empty()
            && self.attempts.is_empty()
            && self.resets.is_empty()
            && self.completed.is_empty()
            && self.retained.is_empty()
    }
}

/// Spaces pushes evenly at the configured rate, and never lets more than
/// `rate` of them into any [`PACING_WINDOW`] (exact sliding window).
struct PushPacer {
    rate: usize,
    spacing: Option<Duration>,
    next_slot: Instant,
    /// Send times of the last `rate` pushes.
    recent: VecDeque<Instant>,
}

impl PushPacer {
    fn new(rate: Option<u32>) -> Self {
        let rate = rate.filter(|r| *r > 0);
        Self {
            rate: rate.map_or(0, |r| r as usize),
            spacing: rate.map(|r| PACING_WINDOW / r),
            next_slot: Instant::now(),
            recent: VecDeque::new(),
        }
    }

    /// When the next slot opens (for sleeping until then).
    fn next_slot(&self) -> Instant {
        match self.recent.front() {
            Some(oldest) if self.recent.len() >= self.rate => {
                self.next_slot.max(*oldest + PACING_WINDOW)
            }
            Some(_) | None => self.next_slot,
        }
    }

    /// Takes a slot if one is due.
    fn try_take(&mut self, now: Instant) -> bool {
        let Some(spacing) = self.spacing else {
            return true;
        };
        if now < self.next_slot() {
            return false;
        }
        let earliest = now.checked_sub(PACING_CATCH_UP).unwrap_or(now);
        self.next_slot = self.next_slot.max(earliest) + spacing;
        if self.recent.len() >= self.rate {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        true
    }
}

/// Devices collected for one trigger until the debounce window closes.
struct Debounced {
    closes_at: Instant,
    devices: BTreeSet<DeviceId>,
}

pub struct Engine {
    ctx: EngineContext,
    runs: HashMap<Uuid, RunProgress>,
    in_flight: HashMap<DeviceId, InFlight>,
    /// Devices with a push awaiting confirmation (bounded by `max_in_flight`).
    pushed: HashSet<DeviceId>,
    push_queue: VecDeque<DeviceId>,
    pacer: PushPacer,
    debounced: HashMap<Trigger, Debounced>,
    pending: Pending,
    last_flush: Instant,
    /// Cancelled at shutdown; a write retrying against a dead database gives up then.
    shutdown: CancellationToken,
}

impl Engine {
    pub fn new(ctx: EngineContext) -> Self {
        let pacer = PushPacer::new(ctx.settings.push_rate);
        Self {
            ctx,
            runs: HashMap::new(),
            in_flight: HashMap::new(),
            pushed: HashSet::new(),
            push_queue: VecDeque::new(),
            pacer,
            debounced: HashMap::new(),
            pending: Pending::default(),
            last_flush: Instant::now(),
            shutdown: CancellationToken::new(),
        }
    }

    /// Runs until `token` is cancelled, then writes what is pending.
    pub async fn run(
        mut self,
        mut commands: mpsc::Receiver<EngineCommand>,
        token: CancellationToken,
    ) {
        self.shutdown = token.clone();
        let mut next_scan = Instant::now() + SCAN_INTERVAL;
        let mut next_resync = self
            .ctx
            .settings
            .resync_interval
            .map(|i| Instant::now() + i);
        loop {
            let wake = self.next_wake(next_scan, next_resync);
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
                () = tokio::time::sleep_until(wake.into()) => {}
            }
            let now = Instant::now();
            if now >= next_scan {
                self.scan(now).await;
                next_scan = now + SCAN_INTERVAL;
            }
            if let (Some(at), Some(interval)) = (next_resync, self.ctx.settings.resync_interval) {
                if now >= at {
                    self.resync().await;
                    next_resync = Some(now + interval);
                }
            }
            self.close_debounced(now).await;
            self.drain_push_queue().await;
            self.publish_stats();
            if self.pending.outcomes.len() >= FLUSH_SIZE
                || (!self.pending.is_empty() && self.last_flush.elapsed() >= FLUSH_INTERVAL)
            {
                self.flush().await;
            }
        }
        self.flush().await;
    }

    fn next_wake(&self, next_scan: Instant, next_resync: Option<Instant>) -> Instant {
        let mut wake = next_scan;
        if let Some(at) = next_resync {
            wake = wake.min(at);
        }
        if !self.push_queue.is_empty() && self.pushed.len() < self.ctx.settings.max_in_flight {
            wake = wake.min(self.pacer.next_slot());
        }
        for d in self.debounced.values() {
            wake = wake.min(d.closes_at);
        }
        if !self.pending.is_empty() {
            wake = wake.min(self.last_flush + FLUSH_INTERVAL);
        }
        wake
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
                        self.advance(&id, false).await;
                    } else {
                        self.check_drift(&id);
                    }
                }
            }
            EngineCommand::Connectivity(changes) => {
                for (id, online) in changes {
                    self.connectivity_changed(&id, online);
                }
            }
            EngineCommand::ReconcileAll(trigger) => self.reconcile_all(trigger).await,
            EngineCommand::DesiredChanged(ids) => {
                for id in ids {
                    if self.in_flight.contains_key(&id) {
                        // An attempt for the old generation ends superseded.
                        self.advance(&id, false).await;
                    }
                    if !self.in_flight.contains_key(&id) {
                        self.refresh_retained(&id);
                    }
                }
            }
            EngineCommand::DevicesRemoved(ids) => {
                for id in ids {
                    self.push_queue.retain(|queued| *queued != id);
                    for debounced in self.debounced.values_mut() {
                        debounced.devices.remove(&id);
                    }
                    let entry = DeviceEntry::default();
                    self.finish(
                        &id,
                        Outcome::Skipped(super::SkipReason::Deleted),
                        &entry,
                        None,
                    );
                }
            }
            EngineCommand::SyncRetained => {
                for id in self.ctx.fleet.ids_with_retained_behind() {
                    if !self.in_flight.contains_key(&id) {
                        self.refresh_retained(&id);
                    }
                }
            }
        }
    }

    /// Republishes the current desired state as the retained message when
    /// the broker's copy is behind it, without starting an attempt: the
    /// device already runs it or is not attempted now, but a reboot must
    /// never bring it a withdrawn generation.
    fn refresh_retained(&mut self, id: &DeviceId) {
        let Some(entry) = self.ctx.fleet.get(id) else {
            return;
        };
        let Some(desired) = entry.retained_behind() else {
            return;
        };
        self.ctx
            .publisher
            .push(id, desired.generation, &desired.spec);
        self.ctx.metrics.retained_updates.increment(1);
        self.ctx.fleet.set_retained(id, desired.generation);
        self.pending
            .retained
            .push((id.to_string(), desired.generation));
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
            if self.join_attempt_in_flight(&id, run_id) {
                continue;
            }
            let entry = self.ctx.fleet.get(&id).unwrap_or_default();
            self.in_flight.insert(
                id.clone(),
                InFlight {
                    runs: vec![run_id],
                    force,
                    attempt: Attempt::Fresh { force },
                    generation: entry.desired.as_ref().map(|d| d.generation),
                    deadline: None,
                    retry_at: None,
                    queued: false,
                    since: now,
                },
            );
            if let Some(skip) = gate(entry.status, entry.online, entry.desired.is_some()) {
                self.finish(&id, Outcome::Skipped(skip), &entry, None);
            } else {
                self.advance(&id, false).await;
            }
            // Large runs are written in slices, bounding memory per write.
            if self.pending.outcomes.len() >= FLUSH_SIZE {
                self.flush().await;
            }
        }
    }

    /// Lets `run_id` share the attempt already in flight for `id` when it
    /// works towards the current desired generation. An attempt for an older
    /// generation ends `Superseded` first, and the run starts afresh.
    fn join_attempt_in_flight(&mut self, id: &DeviceId, run_id: Uuid) -> bool {
        let entry = self.ctx.fleet.get(id).unwrap_or_default();
        let current = entry.desired.as_ref().map(|d| d.generation);
        let Some(flight) = self.in_flight.get_mut(id) else {
            return false;
        };
        if flight.generation == current {
            flight.runs.push(run_id);
            return true;
        }
        self.conclude(id, Outcome::Superseded, &entry);
        false
    }

    /// Decides for one in-flight device and carries the decision out.
    /// `permit`: a push slot was already taken for this device.
    async fn advance(&mut self, id: &DeviceId, permit: bool) {
        let entry = self.ctx.fleet.get(id).unwrap_or_default();
        let Some(desired) = entry.desired_for_decision() else {
            self.conclude(
                id,
                Outcome::Skipped(super::SkipReason::NoDesiredSpec),
                &entry,
            );
            return;
        };
        let Some(flight) = self.in_flight.get_mut(id) else {
            return;
        };
        if flight.retry_at.is_some() || flight.queued {
            return;
        }
        match decide(&desired, &entry.actual(), &flight.attempt) {
            Decision::Finish(outcome) => self.conclude(id, outcome, &entry),
            Decision::Push => {
                let may_push = permit
                    || (self.push_queue.is_empty()
                        && self.pushed.len() < self.ctx.settings.max_in_flight
                        && self.pacer.try_take(Instant::now()));
                if !may_push {
                    flight.queued = true;
                    self.push_queue.push_back(id.clone());
                    return;
                }
                flight.attempt = Attempt::Pushed {
                    generation: desired.generation,
                    seq_at_push: entry.reported_seq(),
                    expired: false,
                };
                flight.generation = Some(desired.generation);
                flight.deadline = Some(Instant::now() + self.ctx.settings.push_timeout);
                self.pushed.insert(id.clone());
                self.set_status(id, DeviceStatus::Provisioning);
                if let Some(state) = &entry.desired {
                    self.ctx.publisher.push(id, state.generation, &state.spec);
                    self.ctx.metrics.pushes.increment(1);
                    self.ctx.fleet.set_retained(id, state.generation);
                    self.pending
                        .retained
                        .push((id.to_string(), state.generation));
                }
            }
            Decision::AskForReport => {
                flight.attempt = Attempt::AwaitingReport { expired: false };
                flight.deadline = Some(Instant::now() + self.ctx.settings.push_timeout);
                self.ctx.publisher.ask_for_report(id).await;
                self.ctx.metrics.report_requests.increment(1);
            }
            Decision::Wait => {}
        }
    }

    /// Pushes queued devices as pacing and the in-flight cap allow.
    async fn drain_push_queue(&mut self) {
        while !self.push_queue.is_empty() && self.pushed.len() < self.ctx.settings.max_in_flight {
            if !self.pacer.try_take(Instant::now()) {
                break;
            }
            let Some(id) = self.push_queue.pop_front() else {
                break;
            };
            let Some(flight) = self.in_flight.get_mut(&id) else {
                continue;
            };
            if !flight.queued {
                continue;
            }
            flight.queued = false;
            self.advance(&id, true).await;
        }
    }

    /// Expires deadlines and starts due retries.
    async fn scan(&mut self, now: Instant) {
        let mut due = Vec::new();
        for (id, flight) in &mut self.in_flight {
            if flight.retry_at.is_some_and(|at| at <= now) {
                flight.retry_at = None;
                due.push(id.clone());
                continue;
            }
            if flight.deadline.is_some_and(|at| at <= now) {
                flight.deadline = None;
                match &mut flight.attempt {
                    Attempt::Fresh { .. } => {}
                    Attempt::AwaitingReport { expired } | Attempt::Pushed { expired, .. } => {
                        *expired = true;
                        due.push(id.clone());
                    }
                }
            }
        }
        for id in due {
            self.advance(&id, false).await;
        }
    }

    /// Applies retry policy to a decided outcome, then finishes or retries.
    fn conclude(&mut self, id: &DeviceId, outcome: Outcome, entry: &DeviceEntry) {
        let Some(flight) = self.in_flight.get_mut(id) else {
            return;
        };
        let run_id = flight.runs.first().copied().unwrap_or_default();
        let attempt_number = entry.failures + 1;
        self.pushed.remove(id);
        match &outcome {
            Outcome::Failed(reason) => {
                let jitter = rand::random_range(0.5..=1.0);
                let after = self
                    .ctx
                    .settings
                    .retry
                    .after_failure(attempt_number, jitter);
                let (next_attempt_at, status) = match after {
                    AfterFailure::RetryAfter(delay) => {
                        flight.attempt = Attempt::Fresh {
                            force: flight.force,
                        };
                        flight.deadline = None;
                        flight.retry_at = Some(Instant::now() + delay);
                        let at = chrono::Utc::now()
                            + chrono::Duration::from_std(delay).unwrap_or_default();
                        (Some(at), DeviceStatus::Failed)
                    }
                    AfterFailure::Quarantine => (None, DeviceStatus::Quarantined),
                };
                self.pending.attempts.push(AttemptRow {
                    device_id: id.to_string(),
                    run_id,
                    attempt: attempt_number,
                    failures: attempt_number,
                    generation: flight.generation,
                    result: "failed",
                    reason: Some(reason.to_string()),
                    next_attempt_at,
                    status: Some(status.as_str()),
                });
                self.ctx.fleet.set_failures(id, attempt_number);
                self.ctx.fleet.set_status(id, status);
                match after {
                    AfterFailure::RetryAfter(_) => {
                        self.ctx.metrics.retries.increment(1);
                    }
                    AfterFailure::Quarantine => {
                        self.ctx.metrics.quarantined.increment(1);
                        self.pending.drafts.push(EventDraft {
                            event_type: EventType::DeviceQuarantined,
                            subject: id.to_string(),
                            run_id: Some(run_id),
                            generation: flight.generation,
                            data: json!({"attempts": attempt_number, "last_error": reason.to_string()}),
                        });
                        self.finish(id, outcome, entry, Some(DeviceStatus::Quarantined));
                    }
                }
            }
            Outcome::Provisioned | Outcome::Superseded => {
                self.pending.attempts.push(AttemptRow {
                    device_id: id.to_string(),
                    run_id,
                    attempt: attempt_number,
                    failures: match outcome {
                        Outcome::Provisioned => 0,
                        Outcome::AlreadyConverged
                        | Outcome::Failed(_)
                        | Outcome::Skipped(_)
                        | Outcome::Superseded => entry.failures,
                    },
                    generation: flight.generation,
                    result: outcome.kind().as_str(),
                    reason: None,
                    next_attempt_at: None,
                    status: None,
                });
                if outcome == Outcome::Provisioned {
                    self.ctx.fleet.set_failures(id, 0);
                }
                self.finish(id, outcome, entry, None);
            }
            Outcome::AlreadyConverged => {
                if entry.failures > 0 {
                    self.pending.resets.push(id.to_string());
                    self.ctx.fleet.set_failures(id, 0);
                }
                self.finish(id, outcome, entry, None);
            }
            Outcome::Skipped(_) => self.finish(id, outcome, entry, None),
        }
    }

    /// Records `outcome` for every run waiting on this device's attempt.
    fn finish(
        &mut self,
        id: &DeviceId,
        outcome: Outcome,
        entry: &DeviceEntry,
        status: Option<DeviceStatus>,
    ) {
        let Some(flight) = self.in_flight.remove(id) else {
            return;
        };
        self.pushed.remove(id);
        let kind = outcome.kind();
        let status = status.or_else(|| status_after(&outcome));
        if let Some(status) = status {
            self.ctx.fleet.set_status(id, status);
        }
        let reason = outcome.reason();
        let generation = flight.generation;
        let health = entry.health.map(|h| h.as_str().to_owned());
        match &outcome {
            Outcome::Provisioned => {
                self.ctx
                    .metrics
                    .convergence_latency
                    .record(flight.since.elapsed().as_secs_f64());
            }
            Outcome::AlreadyConverged
            | Outcome::Failed(_)
            | Outcome::Skipped(_)
            | Outcome::Superseded => {}
        }
        match &outcome {
            // Nothing was pushed in this attempt: the broker may still hold
            // an older generation retained, which a reboot would apply.
            Outcome::AlreadyConverged | Outcome::Failed(_) | Outcome::Skipped(_) => {
                self.refresh_retained(id);
            }
            // Pushed (the retained message is current), or another attempt
            // for the newer generation takes over.
            Outcome::Provisioned | Outcome::Superseded => {}
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
                status: status.map(DeviceStatus::as_str),
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
    }

    fn set_status(&mut self, id: &DeviceId, status: DeviceStatus) {
        self.ctx.fleet.set_status(id, status);
        self.pending.statuses.push((id.to_string(), status));
    }

    /// A converged device whose new report differs from its desired state
    /// has drifted: record it and schedule a remediation run.
    fn check_drift(&mut self, id: &DeviceId) {
        let Some(entry) = self.ctx.fleet.get(id) else {
            return;
        };
        let (Some(desired), Some(reported)) = (&entry.desired, &entry.reported) else {
            return;
        };
        if entry.status != DeviceStatus::Converged || desired.digest == reported.digest {
            return;
        }
        self.ctx.metrics.drifts.increment(1);
        self.set_status(id, DeviceStatus::Drifted);
        self.pending.drafts.push(EventDraft {
            event_type: EventType::DeviceDrifted,
            subject: id.to_string(),
            run_id: None,
            generation: Some(desired.generation),
            data: json!({
                "desired_digest": desired.digest.to_string(),
                "reported_digest": reported.digest.to_string(),
                "reported_seq": reported.seq,
            }),
        });
        self.debounce(Trigger::Drift, id.clone());
    }

    fn connectivity_changed(&mut self, id: &DeviceId, online: bool) {
        let Some(entry) = self.ctx.fleet.get(id) else {
            return;
        };
        if online {
            if entry.status == DeviceStatus::Offline {
                self.debounce(Trigger::Reconnect, id.clone());
            }
        } else if !self.in_flight.contains_key(id) && entry.status != DeviceStatus::Quarantined {
            self.set_status(id, DeviceStatus::Offline);
        }
    }

    fn debounce(&mut self, trigger: Trigger, id: DeviceId) {
        let closes_at = Instant::now() + self.ctx.settings.debounce;
        self.debounced
            .entry(trigger)
            .or_insert_with(|| Debounced {
                closes_at,
                devices: BTreeSet::new(),
            })
            .devices
            .insert(id);
    }

    async fn close_debounced(&mut self, now: Instant) {
        let due: Vec<Trigger> = self
            .debounced
            .iter()
            .filter(|(_, d)| d.closes_at <= now)
            .map(|(t, _)| *t)
            .collect();
        for trigger in due {
            let Some(batch) = self.debounced.remove(&trigger) else {
                continue;
            };
            self.start_own_run(trigger, batch.devices.into_iter().collect())
                .await;
        }
    }

    async fn reconcile_all(&mut self, trigger: Trigger) {
        let targets = self.ctx.fleet.ids_with_desired_state();
        if targets.is_empty() {
            return;
        }
        self.start_own_run(trigger, targets).await;
    }

    /// Periodic resync: asks devices with stale reports for a fresh one and
    /// re-checks every device against what it last reported.
    async fn resync(&mut self) {
        let stale_cutoff = chrono::Utc::now()
            - chrono::Duration::from_std(self.ctx.settings.stale_after)
                .unwrap_or(chrono::Duration::MAX);
        for id in self.ctx.fleet.ids_reported_before(stale_cutoff) {
            let online = self.ctx.fleet.get(&id).and_then(|e| e.online);
            if online != Some(false) && !self.in_flight.contains_key(&id) {
                self.ctx.publisher.ask_for_report(&id).await;
                self.ctx.metrics.report_requests.increment(1);
            }
        }
        self.reconcile_all(Trigger::Resync).await;
    }

    /// Commits a run the engine starts itself and begins it. If the commit
    /// fails (database down), the devices wait in the debounce set and the
    /// run is tried again a debounce window later.
    async fn start_own_run(&mut self, trigger: Trigger, targets: Vec<DeviceId>) {
        let run = NewRun {
            targets: targets.clone(),
            trigger,
            force: false,
            spec: None,
            started_by: None,
        };
        match commit_run(
            &self.ctx.pool,
            &self.ctx.device_writes,
            &self.ctx.fleet,
            &self.ctx.event_source,
            run,
        )
        .await
        {
            Ok(run) => {
                self.ctx.events_wake.notify_one();
                self.ctx.metrics.events_committed.increment(1);
                tracing::info!(run_id = %run.run_id, trigger = run.trigger.as_str(), targets = run.targets.len(), "run started");
                self.start_run(
                    run.run_id,
                    run.trigger.as_str().to_owned(),
                    run.targets,
                    run.force,
                    0,
                )
                .await;
            }
            Err(e) => {
                tracing::error!(error = %e, trigger = trigger.as_str(), "could not start a run; will retry");
                for id in targets {
                    self.debounce(trigger, id);
                }
            }
        }
    }

    fn publish_stats(&self) {
        let stats = &self.ctx.stats;
        stats
            .queued_pushes
            .store(self.push_queue.len() as u64, Ordering::Relaxed);
        stats
            .pushes_in_flight
            .store(self.pushed.len() as u64, Ordering::Relaxed);
        stats
            .attempts_in_flight
            .store(self.in_flight.len() as u64, Ordering::Relaxed);
        self.ctx
            .metrics
            .push_queue_depth
            .set(self.push_queue.len() as f64);
        self.ctx
            .metrics
            .pushes_in_flight
            .set(self.pushed.len() as f64);
        self.ctx
            .metrics
            .attempts_in_flight
            .set(self.in_flight.len() as f64);
    }

    /// Writes pending results in one transaction, retrying until it commits
    /// or the engine is cancelled.
    async fn flush(&mut self) {
        let token = self.shutdown.clone();
        self.last_flush = Instant::now();
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let mut backoff = Duration::from_millis(100);
        loop {
            let started = Instant::now();
            self.ctx.stall.writing();
            match self.write(&pending).await {
                Ok(committed) => {
                    self.ctx.stall.progressed();
                    self.ctx
                        .metrics
                        .db_batch_outcomes
                        .record(started.elapsed().as_secs_f64());
                    self.after_commit(committed);
                    self.last_flush = Instant::now();
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, "writing outcomes failed; retrying in {backoff:?}");
                    tokio::select! {
                        () = token.cancelled() => {
                            tracing::error!(
                                "shutting down with {} unwritten outcomes; their runs resume at next start",
                                pending.outcomes.len()
                            );
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
        let _one_writer = self.ctx.device_writes.lock().await;
        let mut tx = self.ctx.pool.begin().await.map_err(|e| StoreError::Db {
            context: "starting a transaction",
            source: e,
        })?;
        let per_run: Vec<(Uuid, OutcomeCounts)> =
            pending.per_run.iter().map(|(k, v)| (*k, *v)).collect();
        let mut by_status: HashMap<DeviceStatus, Vec<String>> = HashMap::new();
        for (id, status) in &pending.statuses {
            by_status.entry(*status).or_default().push(id.clone());
        }
        for (status, ids) in &by_status {
            store::devices::set_status(&mut tx, ids, status.as_str()).await?;
        }
        store::devices::record_attempts(&mut tx, &pending.attempts).await?;
        store::devices::record_retained(&mut tx, &pending.retained).await?;
        store::devices::reset_attempts(&mut tx, &pending.resets).await?;
        store::runs::record_outcomes(&mut tx, &pending.outcomes, &per_run).await?;
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
            // Nobody listening is fine.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots a 200/s pacer hands out when woken every `step_ms` for
    /// `total_ms`, the first wake-up `late_ms` after it was created.
    fn slots_taken_from(late_ms: u64, step_ms: usize, total_ms: u64) -> Vec<Instant> {
        let mut pacer = PushPacer::new(Some(200));
        let start = pacer.next_slot() + Duration::from_millis(late_ms);
        let mut taken = Vec::new();
        for ms in (0..total_ms).step_by(step_ms) {
            let now = start + Duration::from_millis(ms);
            let before = taken.len();
            while pacer.try_take(now) {
                taken.push(now);
                assert!(
                    taken.len() - before <= 200,
                    "more than a window's worth of slots at one instant"
                );
            }
        }
        taken
    }

    /// Slots a 200/s pacer hands out when woken every `step_ms` for `total_ms`.
    fn slots_taken(step_ms: usize, total_ms: u64) -> Vec<Instant> {
        slots_taken_from(0, step_ms, total_ms)
    }

    /// The most slots within any [`PACING_WINDOW`].
    fn peak_per_window(taken: &[Instant]) -> usize {
        (0..taken.len())
            .map(|i| {
                taken[i..]
                    .iter()
                    .take_while(|u| **u < taken[i] + PACING_WINDOW)
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    /// The most slots within any one-second window.
    fn peak_per_second(taken: &[Instant]) -> usize {
        (0..taken.len())
            .map(|i| {
                taken[i..]
                    .iter()
                    .take_while(|u| **u < taken[i] + Duration::from_secs(1))
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn pacing_never_allows_more_than_the_rate_in_any_second() {
        // Woken every 1 ms (tokio's timer granularity) for 3 s.
        let taken = slots_taken(1, 3_000);
        assert!(peak_per_second(&taken) <= 200);
        assert!(
            taken.len() >= 540,
            "pacing too slow: {} in 3 s",
            taken.len()
        );
    }

    #[test]
    fn late_wake_ups_catch_up_without_breaking_the_window() {
        // Woken only every 8 ms, as if each wake-up followed a database write.
        let taken = slots_taken(8, 5_000);
        assert!(peak_per_second(&taken) <= 200);
        assert!(
            taken.len() >= 850,
            "catch-up too weak: {} in 5 s",
            taken.len()
        );
    }

    #[test]
    fn a_slot_opens_exactly_one_spacing_after_the_last() {
        let mut pacer = PushPacer::new(Some(200));
        let first = pacer.next_slot();
        assert!(pacer.try_take(first));
        assert!(!pacer.try_take(first), "one slot per spacing");
        let second = pacer.next_slot();
        assert_eq!(second, first + PACING_WINDOW / 200);
        assert!(!pacer.try_take(second - Duration::from_nanos(1)));
        assert!(pacer.try_take(second));
    }

    #[test]
    fn the_sliding_window_holds_when_catching_up_on_a_late_start() {
        // Woken first 10 ms late, the pacer catches up on that lateness
        // with a small burst; spacing alone would then fit 202 slots into
        // one window, the window keeps it at the rate.
        let taken = slots_taken_from(10, 1, 3_000);
        assert!(taken.len() >= 540, "pacing too slow: {}", taken.len());
        assert_eq!(peak_per_window(&taken), 200);
    }

    #[test]
    fn no_rate_means_no_pacing() {
        let mut pacer = PushPacer::new(None);
        let now = Instant::now();
        assert!((0..10_000).all(|_| pacer.try_take(now)));
    }
}
