//! Staged rollouts: waves sized over the devices that need a push (never
//! over those already converged), the gates that pause a rollout when a
//! wave goes wrong, and a rollout's state through its waves, pauses,
//! approvals, resumes and aborts, and its stored form (restored after a
//! restart) and API view. Pure: time is passed in.

use std::fmt;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use idem_protocol::api::{
    ApprovalView, PausedView, RolloutStateName, RolloutView, WaveState, WaveView,
};
use serde::{Deserialize, Serialize};

use super::outcome::OutcomeKind;

/// Waves in one rollout, at most.
pub const MAX_WAVES: usize = 20;

/// Where a wave ends, counted over the devices that need a push:
/// cumulative, so `[1%, 10%, 100%]` is a 1 % canary, then up to 10 %,
/// then the rest.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaveSize {
    /// This many devices in this and the earlier waves.
    Count(u64),
    /// This share (0 < p ≤ 100) of them, rounded up.
    Percent(f64),
}

impl WaveSize {
    /// The wave's cumulative end among `needing` devices.
    fn end(self, needing: u64) -> u64 {
        match self {
            WaveSize::Count(n) => n.min(needing),
            // Rounded up, so a 1 % canary of 50 devices is one device;
            // `needing` fits an f64 exactly far beyond any fleet.
            WaveSize::Percent(p) => {
                let share = (needing as f64 * p / 100.0).ceil();
                (share as u64).min(needing)
            }
        }
    }
}

impl fmt::Display for WaveSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaveSize::Count(n) => write!(f, "{n}"),
            WaveSize::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// What follows a wave once its last device has its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pause {
    /// The next wave starts at once.
    None,
    /// The next wave starts after this long.
    For(Duration),
    /// The rollout waits for an operator's resume.
    Manual,
}

/// A failure bound: a count, or a share of the wave's devices.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureLimit {
    Count(u64),
    Ratio(f64),
}

/// The gates of one wave; a breach pauses the rollout.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Gates {
    /// Provisioned devices over the wave's devices, at least.
    pub min_success_ratio: Option<f64>,
    /// Failed devices, at most.
    pub max_failures: Option<FailureLimit>,
}

/// One wave as asked for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WaveSpec {
    pub size: WaveSize,
    pub pause: Pause,
    pub gates: Gates,
    /// The rollout goes past this wave only once someone other than its
    /// author approved it.
    pub approve: bool,
}

impl WaveSpec {
    /// A wave of `size` with no pause, no gate and no approval.
    pub fn sized(size: WaveSize) -> Self {
        Self {
            size,
            pause: Pause::None,
            gates: Gates::default(),
            approve: false,
        }
    }
}

/// The waves of a rollout, checked: cumulative sizes that increase and end
/// at 100 %, ratios within [0, 1].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolloutSpec {
    waves: Vec<WaveSpec>,
}

/// Why waves are refused; `field` names the offending value as the API
/// body writes it (`rollout.waves[1].size`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RolloutError {
    #[error("`rollout.waves` is empty; give at least one wave, the last \"100%\"")]
    NoWaves,
    #[error("`rollout.waves` has {0} waves; at most {MAX_WAVES} are allowed")]
    TooManyWaves(usize),
    #[error("`{field}` is {value}; a percentage is above 0 and at most 100")]
    PercentOutOfRange { field: String, value: f64 },
    #[error("`{field}` is 0; a wave holds at least one device")]
    ZeroCount { field: String },
    #[error("`{field}` ({this}) is not above the wave before it ({previous}); sizes are cumulative and increase")]
    NotIncreasing {
        field: String,
        previous: WaveSize,
        this: WaveSize,
    },
    #[error("`{field}` is a count after a percentage; counts come first (`[10, 500, \"100%\"]`)")]
    CountAfterPercent { field: String },
    #[error("`{field}` is {last}; the last wave must be \"100%\" so that every device is reached")]
    NotEndingAtAll { field: String, last: WaveSize },
    #[error("`{field}` is {value}; a ratio is within [0, 1]")]
    RatioOutOfRange { field: String, value: f64 },
    #[error(
        "`{field}` is set on the last wave, but {what} holds back the waves after its own and \
         none follows; drop it, or add a wave after it"
    )]
    NothingFollows { field: String, what: &'static str },
}

impl RolloutSpec {
    pub fn new(waves: Vec<WaveSpec>) -> Result<Self, RolloutError> {
        if waves.is_empty() {
            return Err(RolloutError::NoWaves);
        }
        if waves.len() > MAX_WAVES {
            return Err(RolloutError::TooManyWaves(waves.len()));
        }
        let size_field = |i: usize| format!("rollout.waves[{i}].size");
        let mut previous: Option<WaveSize> = None;
        for (i, wave) in waves.iter().enumerate() {
            match wave.size {
                WaveSize::Percent(p) if !(p > 0.0 && p <= 100.0) => {
                    return Err(RolloutError::PercentOutOfRange {
                        field: size_field(i),
                        value: p,
                    })
                }
                WaveSize::Count(0) => {
                    return Err(RolloutError::ZeroCount {
                        field: size_field(i),
                    })
                }
                WaveSize::Percent(_) | WaveSize::Count(_) => {}
            }
            match (previous, wave.size) {
                (Some(WaveSize::Percent(_)), WaveSize::Count(_)) => {
                    return Err(RolloutError::CountAfterPercent {
                        field: size_field(i),
                    })
                }
                (Some(WaveSize::Count(a)), WaveSize::Count(b)) if b <= a => {
                    return Err(not_increasing(size_field(i), previous, wave.size))
                }
                (Some(WaveSize::Percent(a)), WaveSize::Percent(b)) if b <= a => {
                    return Err(not_increasing(size_field(i), previous, wave.size))
                }
                (Some(_) | None, _) => {}
            }
            check_ratio(
                format!("rollout.waves[{i}].gates.min_success_ratio"),
                wave.gates.min_success_ratio,
            )?;
            if let Some(FailureLimit::Ratio(r)) = wave.gates.max_failures {
                check_ratio(format!("rollout.waves[{i}].gates.max_failures"), Some(r))?;
            }
            previous = Some(wave.size);
        }
        let last = waves.len() - 1;
        let pauses = match waves[last].pause {
            Pause::Manual => true,
            Pause::For(pause) => !pause.is_zero(),
            Pause::None => false,
        };
        let held = if waves[last].approve {
            Some(("approve", "an approval"))
        } else {
            pauses.then_some(("pause", "a pause"))
        };
        if let Some((key, what)) = held {
            return Err(RolloutError::NothingFollows {
                field: format!("rollout.waves[{last}].{key}"),
                what,
            });
        }
        match waves[last].size {
            WaveSize::Percent(100.0) => Ok(Self { waves }),
            size @ (WaveSize::Count(_) | WaveSize::Percent(_)) => {
                Err(RolloutError::NotEndingAtAll {
                    field: size_field(last),
                    last: size,
                })
            }
        }
    }

    pub fn waves(&self) -> &[WaveSpec] {
        &self.waves
    }

    /// Each wave's cumulative end among `needing` devices (the last is
    /// `needing`); a wave may be empty in a small fleet.
    pub fn ends(&self, needing: u64) -> Vec<u64> {
        let mut floor = 0;
        self.waves
            .iter()
            .map(|wave| {
                floor = wave.size.end(needing).max(floor);
                floor
            })
            .collect()
    }
}

/// The wave of each device that needs a push: in id order, the first
/// ones in the first wave (the order a run's target rows store).
pub fn assign_waves<Id: Ord + Clone + std::hash::Hash>(
    spec: &RolloutSpec,
    needing: &[Id],
) -> std::collections::HashMap<Id, usize> {
    let mut sorted: Vec<&Id> = needing.iter().collect();
    sorted.sort_unstable();
    sorted.dedup();
    let ends = spec.ends(sorted.len() as u64);
    let mut wave = 0;
    sorted
        .into_iter()
        .enumerate()
        .map(|(index, id)| {
            while wave + 1 < ends.len() && index as u64 >= ends[wave] {
                wave += 1;
            }
            (id.clone(), wave)
        })
        .collect()
}

fn not_increasing(field: String, previous: Option<WaveSize>, this: WaveSize) -> RolloutError {
    RolloutError::NotIncreasing {
        field,
        previous: previous.unwrap_or(WaveSize::Count(0)),
        this,
    }
}

fn check_ratio(field: String, ratio: Option<f64>) -> Result<(), RolloutError> {
    match ratio {
        Some(value) if !(0.0..=1.0).contains(&value) => {
            Err(RolloutError::RatioOutOfRange { field, value })
        }
        Some(_) | None => Ok(()),
    }
}

/// How one wave's devices ended so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaveCounts {
    /// Devices in the wave.
    pub size: u64,
    pub provisioned: u64,
    pub failed: u64,
    pub skipped: u64,
    /// Matched before their push was due (a report, or another run).
    #[serde(default)]
    pub already_converged: u64,
    /// A newer desired change took them over.
    #[serde(default)]
    pub superseded: u64,
}

impl WaveCounts {
    pub fn decided(&self) -> u64 {
        self.provisioned + self.failed + self.skipped + self.already_converged + self.superseded
    }

    /// Devices that ended matching their target.
    pub fn succeeded(&self) -> u64 {
        self.provisioned + self.already_converged
    }

    fn add(&mut self, outcome: OutcomeKind) {
        let count = match outcome {
            OutcomeKind::Provisioned => &mut self.provisioned,
            OutcomeKind::Failed => &mut self.failed,
            OutcomeKind::Skipped => &mut self.skipped,
            OutcomeKind::AlreadyConverged => &mut self.already_converged,
            OutcomeKind::Superseded => &mut self.superseded,
        };
        *count += 1;
    }

    pub fn is_done(&self) -> bool {
        self.decided() >= self.size
    }
}

/// Which gate a wave breached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateKind {
    MinSuccessRatio,
    MaxFailures,
    MaxFailureRatio,
}

impl GateKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GateKind::MinSuccessRatio => "min_success_ratio",
            GateKind::MaxFailures => "max_failures",
            GateKind::MaxFailureRatio => "max_failure_ratio",
        }
    }
}

/// A breached gate with its figures: `limit` and `observed` in the gate's
/// own unit (a count, or a ratio of the wave's devices).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Breach {
    pub gate: GateKind,
    pub limit: f64,
    pub observed: f64,
}

/// The first gate `counts` breach for certain: a failure bound as soon as
/// failures pass it (they only grow), a success ratio as soon as it can no
/// longer be met even if every undecided device succeeds. Ratios are over
/// the wave's devices a newer change did not take over (`superseded`
/// devices are no verdict on this change). `None` while every gate can
/// still hold.
pub fn breach(gates: &Gates, counts: &WaveCounts) -> Option<Breach> {
    let judged = counts.size.saturating_sub(counts.superseded);
    if judged == 0 {
        return None;
    }
    let judged_f = judged as f64;
    if let Some(limit) = gates.max_failures {
        let (gate, limit, observed) = match limit {
            FailureLimit::Count(n) => (GateKind::MaxFailures, n as f64, counts.failed as f64),
            FailureLimit::Ratio(r) => (
                GateKind::MaxFailureRatio,
                r,
                counts.failed as f64 / judged_f,
            ),
        };
        if observed > limit {
            return Some(Breach {
                gate,
                limit,
                observed,
            });
        }
    }
    if let Some(limit) = gates.min_success_ratio {
        let undecided = counts.size.saturating_sub(counts.decided());
        let best = (counts.succeeded() + undecided) as f64 / judged_f;
        if best < limit {
            return Some(Breach {
                gate: GateKind::MinSuccessRatio,
                limit,
                // The ratio as it stands when the breach is certain.
                observed: counts.succeeded() as f64 / judged_f,
            });
        }
    }
    None
}

/// Why a rollout is paused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PauseReason {
    /// A gate of wave `wave` was breached.
    Gate(Breach),
    /// Wave `wave` asked for a manual resume.
    Manual,
    /// Wave `wave` needs an approval before the next one starts.
    Approval,
    /// The next wave starts at `until` by itself.
    Timed { until: Instant },
}

impl PauseReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            PauseReason::Gate(_) => "gate",
            PauseReason::Manual => "manual",
            PauseReason::Approval => "approval",
            PauseReason::Timed { .. } => "timed",
        }
    }
}

/// Where a rollout stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RolloutState {
    /// Wave `wave` is being pushed.
    Running {
        wave: usize,
    },
    /// After (or, for a gate, during) wave `wave`.
    Paused {
        wave: usize,
        reason: PauseReason,
    },
    Completed,
    Aborted,
}

impl RolloutState {
    pub fn name(&self) -> RolloutStateName {
        match self {
            RolloutState::Running { .. } => RolloutStateName::Running,
            RolloutState::Paused { .. } => RolloutStateName::Paused,
            RolloutState::Completed => RolloutStateName::Completed,
            RolloutState::Aborted => RolloutStateName::Aborted,
        }
    }

    /// The state in words, as a refused action names it.
    pub fn as_str(&self) -> &'static str {
        match self {
            RolloutState::Running { .. } => "running",
            RolloutState::Paused { .. } => "paused",
            RolloutState::Completed => "completed",
            RolloutState::Aborted => "aborted",
        }
    }
}

/// What a step of a rollout did, for events and the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transition {
    WaveStarted { wave: usize },
    WaveCompleted { wave: usize, counts: WaveCounts },
    Paused { wave: usize, reason: PauseReason },
    Resumed { wave: usize },
    Approved { wave: usize },
    Completed,
    Aborted,
}

/// An operator action a rollout's state does not allow.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum NotNow {
    #[error("the rollout is {0}, not paused")]
    NotPaused(&'static str),
    #[error("the rollout is waiting for an approval, not a resume")]
    AwaitingApproval,
    #[error("the rollout is not waiting for an approval (it is {0})")]
    NoApprovalPending(&'static str),
    #[error("the rollout has {0} already")]
    Ended(&'static str),
    #[error("the rollout's author cannot approve it; another operator's token must")]
    SelfApproval,
}

/// An approval of a wave: who, when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    pub wave: usize,
    pub by: String,
    pub at: DateTime<Utc>,
}

/// One rollout: its waves over the devices that needed a push when it
/// started, their counts, and where it stands.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    spec: RolloutSpec,
    counts: Vec<WaveCounts>,
    /// Waves whose breached gate an operator resumed past: not evaluated
    /// again (its failures only grow, so it would pause at every outcome).
    waived: Vec<bool>,
    state: RolloutState,
    /// The wave running, or the last one started.
    current: usize,
    /// The token that started it: the one that cannot approve it.
    author: Option<String>,
    approvals: Vec<Approval>,
    early: Option<EarlyPushes>,
}

/// The pushes marked as possibly sent before their own write: every
/// device of a wave before `wave`, and those of wave `wave` with ids up to
/// `last` (the order a wave's pushes go in). The mark runs a little ahead
/// of the pushes (the running wave's, and the next wave's when nothing can
/// stop it), only ever grows, and is stored with the rollout: a restart
/// waits for a marked device's answer instead of pushing it again, and a
/// marked push leaves without a write of its own once the mark is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EarlyPushes {
    pub wave: usize,
    pub last: String,
}

impl EarlyPushes {
    /// Whether the device `id` of wave `wave` is marked.
    pub fn covers(&self, wave: usize, id: &str) -> bool {
        wave < self.wave || (wave == self.wave && id <= self.last.as_str())
    }
}

impl Rollout {
    /// A rollout of `spec` over `needing` devices, by `author`, its first
    /// non-empty wave started (or completed at once when nothing needs a
    /// push).
    pub fn start(
        spec: RolloutSpec,
        needing: u64,
        author: Option<String>,
    ) -> (Self, Vec<Transition>) {
        let counts = spec
            .ends(needing)
            .iter()
            .scan(0, |start, end| {
                let size = end - *start;
                *start = *end;
                Some(WaveCounts {
                    size,
                    ..WaveCounts::default()
                })
            })
            .collect();
        let waived = vec![false; spec.waves.len()];
        let mut rollout = Self {
            spec,
            counts,
            waived,
            state: RolloutState::Running { wave: 0 },
            current: 0,
            author,
            approvals: Vec::new(),
            early: None,
        };
        let mut out = vec![Transition::WaveStarted { wave: 0 }];
        rollout.settle(0, None, &mut out);
        (rollout, out)
    }

    pub fn state(&self) -> RolloutState {
        self.state
    }

    /// The wave running, or the last one started.
    pub fn current_wave(&self) -> usize {
        self.current
    }

    pub fn approvals(&self) -> &[Approval] {
        &self.approvals
    }

    /// The pushes marked as possibly sent before their own write, if any.
    pub fn early(&self) -> Option<&EarlyPushes> {
        self.early.as_ref()
    }

    /// Marks (or, with `None`, unmarks) pushes as possibly sent before
    /// their own write.
    pub fn mark_early(&mut self, early: Option<EarlyPushes>) {
        self.early = early;
    }

    /// Whether the wave after `wave` starts the moment `wave` completes,
    /// whatever its outcomes: there is one, and `wave` has no gate (or an
    /// operator waived it), no pause and no approval.
    pub fn follows_at_once(&self, wave: usize) -> bool {
        let Some(spec) = self.spec.waves.get(wave) else {
            return false;
        };
        let ungated = spec.gates == Gates::default() || self.waived[wave];
        let no_pause = match spec.pause {
            Pause::None => true,
            Pause::For(pause) => pause.is_zero(),
            Pause::Manual => false,
        };
        wave + 1 < self.spec.waves.len() && ungated && no_pause && !spec.approve
    }

    pub fn counts(&self) -> &[WaveCounts] {
        &self.counts
    }

    /// The wave of the device at `index` among those needing a push (in
    /// the order the waves take them).
    pub fn wave_of(&self, index: u64) -> usize {
        let mut end = 0;
        for (wave, counts) in self.counts.iter().enumerate() {
            end += counts.size;
            if index < end {
                return wave;
            }
        }
        self.counts.len().saturating_sub(1)
    }

    /// The devices (by index among those needing a push) that may have
    /// been pushed by now: every one up to the running wave's end; none
    /// more while paused or ended.
    pub fn pushable(&self) -> std::ops::Range<u64> {
        match self.state {
            RolloutState::Running { wave } => {
                0..self.counts[..=wave].iter().map(|c| c.size).sum::<u64>()
            }
            RolloutState::Paused { .. } | RolloutState::Completed | RolloutState::Aborted => 0..0,
        }
    }

    /// Whether a device of wave `wave` may be pushed now.
    pub fn may_push(&self, wave: usize) -> bool {
        match self.state {
            RolloutState::Running { wave: running } => wave <= running,
            RolloutState::Paused { .. } | RolloutState::Completed | RolloutState::Aborted => false,
        }
    }

    /// When a timed pause ends by itself, if the rollout is in one.
    pub fn next_wake(&self) -> Option<Instant> {
        match self.state {
            RolloutState::Paused {
                reason: PauseReason::Timed { until },
                ..
            } => Some(until),
            RolloutState::Paused { .. }
            | RolloutState::Running { .. }
            | RolloutState::Completed
            | RolloutState::Aborted => None,
        }
    }

    /// A device of wave `wave` ended (a retry inside the wave is the same
    /// device, recorded once, when it ends). Returns what followed.
    pub fn record(&mut self, wave: usize, outcome: OutcomeKind, now: Instant) -> Vec<Transition> {
        let mut out = Vec::new();
        let Some(counts) = self.counts.get_mut(wave) else {
            return out;
        };
        counts.add(outcome);
        if wave < self.current && self.counts[wave].decided() == self.counts[wave].size {
            // A wave handed over before its last answer came in.
            self.ended_after_hand_over(wave, &mut out);
            return out;
        }
        if let RolloutState::Running { wave: running } = self.state {
            if running == wave {
                let gates = &self.spec.waves[wave].gates;
                if let Some(breach) =
                    breach(gates, &self.counts[wave]).filter(|_| !self.waived[wave])
                {
                    let reason = PauseReason::Gate(breach);
                    self.state = RolloutState::Paused { wave, reason };
                    out.push(Transition::Paused { wave, reason });
                    return out;
                }
                self.settle(wave, Some(now), &mut out);
            }
        }
        out
    }

    /// Whether wave `wave`, once its last device is pushed, hands over to
    /// the next wave without waiting for its answers: its spec has no
    /// gate, no pause and no approval, so no answer could hold the next
    /// wave back. (A wave whose gate an operator waived on a resume is
    /// not one: its rest is watched to its end before the next starts.)
    pub fn hands_over(&self, wave: usize) -> bool {
        self.follows_at_once(wave)
            && self
                .spec
                .waves
                .get(wave)
                .is_some_and(|spec| spec.gates == Gates::default())
    }

    /// Every device of the running wave `wave` has been pushed (or has its
    /// outcome): when it hands over ([`Rollout::hands_over`]), the next
    /// wave starts now, without waiting for this one's last answers. This
    /// wave completes when they are in.
    pub fn hand_over(&mut self, wave: usize, now: Instant) -> Vec<Transition> {
        let mut out = Vec::new();
        let running = matches!(self.state, RolloutState::Running { wave: w } if w == wave);
        if running && self.hands_over(wave) && !self.counts[wave].is_done() {
            self.next_wave(wave, Some(now), &mut out);
        }
        out
    }

    /// Whether every wave has its outcomes.
    fn all_done(&self) -> bool {
        self.counts.iter().all(WaveCounts::is_done)
    }

    /// Wave `wave`, handed over to the next one, has its last outcome: it
    /// completes (unless the rollout was aborted), and the rollout with it
    /// when that was all it waited for.
    fn ended_after_hand_over(&mut self, wave: usize, out: &mut Vec<Transition>) {
        match self.state {
            RolloutState::Running { wave: running } => {
                out.push(Transition::WaveCompleted {
                    wave,
                    counts: self.counts[wave],
                });
                if running + 1 == self.counts.len() && self.all_done() {
                    self.state = RolloutState::Completed;
                    out.push(Transition::Completed);
                }
            }
            RolloutState::Paused { .. } => out.push(Transition::WaveCompleted {
                wave,
                counts: self.counts[wave],
            }),
            RolloutState::Completed | RolloutState::Aborted => {}
        }
    }

    /// Time passed: a timed pause that is over starts the next wave.
    pub fn tick(&mut self, now: Instant) -> Vec<Transition> {
        let mut out = Vec::new();
        if let RolloutState::Paused {
            wave,
            reason: PauseReason::Timed { until },
        } = self.state
        {
            if now >= until {
                self.next_wave(wave, Some(now), &mut out);
            }
        }
        out
    }

    /// An operator resumes a rollout: paused by a gate, the wave it paused
    /// goes on (its gate waived from then on) and is followed as its spec
    /// says once it completes; after a manual (or timed) pause, the next
    /// wave starts.
    pub fn resume(&mut self, now: Instant) -> Result<Vec<Transition>, NotNow> {
        match self.state {
            RolloutState::Paused {
                wave,
                reason: PauseReason::Gate(_),
            } => {
                self.waived[wave] = true;
                self.state = RolloutState::Running { wave };
                let mut out = vec![Transition::Resumed { wave }];
                self.settle(wave, Some(now), &mut out);
                Ok(out)
            }
            RolloutState::Paused {
                wave,
                reason: PauseReason::Manual | PauseReason::Timed { .. },
            } => {
                let mut out = vec![Transition::Resumed { wave }];
                self.next_wave(wave, Some(now), &mut out);
                Ok(out)
            }
            RolloutState::Paused {
                reason: PauseReason::Approval,
                ..
            } => Err(NotNow::AwaitingApproval),
            RolloutState::Running { .. } => Err(NotNow::NotPaused("running")),
            RolloutState::Completed => Err(NotNow::Ended("completed")),
            RolloutState::Aborted => Err(NotNow::Ended("been aborted")),
        }
    }

    /// `by`, who is not the rollout's author, approves the wave it waits
    /// on, at `now` (`wall` on the clock).
    pub fn approve(
        &mut self,
        by: &str,
        now: Instant,
        wall: DateTime<Utc>,
    ) -> Result<Vec<Transition>, NotNow> {
        match self.state {
            RolloutState::Paused {
                wave,
                reason: PauseReason::Approval,
            } => {
                if self.author.as_deref() == Some(by) {
                    return Err(NotNow::SelfApproval);
                }
                self.approvals.push(Approval {
                    wave,
                    by: by.to_owned(),
                    at: wall,
                });
                let mut out = vec![Transition::Approved { wave }];
                self.after_approval(wave, Some(now), &mut out);
                Ok(out)
            }
            RolloutState::Paused { .. } => Err(NotNow::NoApprovalPending("paused")),
            RolloutState::Running { .. } => Err(NotNow::NoApprovalPending("running")),
            RolloutState::Completed => Err(NotNow::Ended("completed")),
            RolloutState::Aborted => Err(NotNow::Ended("been aborted")),
        }
    }

    /// An operator aborts: nothing more is pushed; the devices not yet
    /// pushed end skipped (`aborted`) by the engine.
    pub fn abort(&mut self) -> Result<Vec<Transition>, NotNow> {
        match self.state {
            RolloutState::Running { .. } | RolloutState::Paused { .. } => {
                self.state = RolloutState::Aborted;
                Ok(vec![Transition::Aborted])
            }
            RolloutState::Completed => Err(NotNow::Ended("completed")),
            RolloutState::Aborted => Err(NotNow::Ended("been aborted")),
        }
    }

    /// Wave `wave` is running: once its last device has its outcome it
    /// completes, and what its spec says follows. `now` is `None` at the
    /// start, when no timed pause can begin yet (an empty first wave
    /// completes and is followed at once).
    fn settle(&mut self, wave: usize, now: Option<Instant>, out: &mut Vec<Transition>) {
        if !self.counts[wave].is_done() {
            return;
        }
        out.push(Transition::WaveCompleted {
            wave,
            counts: self.counts[wave],
        });
        if wave + 1 == self.counts.len() {
            // A wave handed over may still wait for its last answers.
            if self.all_done() {
                self.state = RolloutState::Completed;
                out.push(Transition::Completed);
            }
            return;
        }
        if self.spec.waves[wave].approve && self.pushes_follow(wave) {
            let reason = PauseReason::Approval;
            self.state = RolloutState::Paused { wave, reason };
            out.push(Transition::Paused { wave, reason });
            return;
        }
        self.after_approval(wave, now, out);
    }

    /// Wave `wave` is done (and approved when it had to be): its pause,
    /// then the next wave.
    fn after_approval(&mut self, wave: usize, now: Option<Instant>, out: &mut Vec<Transition>) {
        let pause = if self.pushes_follow(wave) {
            self.spec.waves[wave].pause
        } else {
            Pause::None
        };
        let reason = match (pause, now) {
            (Pause::Manual, _) => Some(PauseReason::Manual),
            (Pause::For(pause), Some(now)) if !pause.is_zero() => {
                Some(PauseReason::Timed { until: now + pause })
            }
            (Pause::For(_), _) | (Pause::None, _) => None,
        };
        match reason {
            Some(reason) => {
                self.state = RolloutState::Paused { wave, reason };
                out.push(Transition::Paused { wave, reason });
            }
            None => self.next_wave(wave, now, out),
        }
    }

    /// Whether a wave after `wave` holds a device to push. An approval or a
    /// pause holds back pushes only: after the last wave that has any (a
    /// small fleet, or none needing a push at all) there is nothing for
    /// them to hold, and the rollout goes through its empty waves to the end.
    fn pushes_follow(&self, wave: usize) -> bool {
        self.counts
            .get(wave + 1..)
            .is_some_and(|after| after.iter().any(|c| c.size > 0))
    }

    fn next_wave(&mut self, wave: usize, now: Option<Instant>, out: &mut Vec<Transition>) {
        let next = wave + 1;
        if next >= self.counts.len() {
            self.state = RolloutState::Completed;
            out.push(Transition::Completed);
            return;
        }
        self.state = RolloutState::Running { wave: next };
        self.current = next;
        out.push(Transition::WaveStarted { wave: next });
        self.settle(next, now, out);
    }

    /// The rollout as stored with its run, at `now` (`wall` on the clock):
    /// what [`Rollout::restore`] takes back after a restart.
    pub fn stored(&self, now: Instant, wall: DateTime<Utc>) -> StoredRollout {
        let state = match self.state {
            RolloutState::Running { .. } => StoredState::Running,
            RolloutState::Paused { reason, .. } => StoredState::Paused {
                reason: StoredPause::of(reason, now, wall),
            },
            RolloutState::Completed => StoredState::Completed,
            RolloutState::Aborted => StoredState::Aborted,
        };
        StoredRollout {
            waves: self.spec.waves.clone(),
            counts: self.counts.clone(),
            waived: self.waived.clone(),
            current: self.current,
            state,
            author: self.author.clone(),
            approvals: self.approvals.clone(),
            early: self.early.clone(),
        }
    }

    /// A rollout as [`Rollout::stored`] left it; a timed pause ends when
    /// it would have (at once if that passed while the server was down).
    pub fn restore(
        stored: StoredRollout,
        now: Instant,
        wall: DateTime<Utc>,
    ) -> Result<Self, RestoreError> {
        let waves = stored.waves.len();
        if waves == 0
            || stored.counts.len() != waves
            || stored.waived.len() != waves
            || stored.current >= waves
        {
            return Err(RestoreError {
                waves,
                counts: stored.counts.len(),
                current: stored.current,
            });
        }
        let wave = stored.current;
        let state = match stored.state {
            StoredState::Running => RolloutState::Running { wave },
            StoredState::Paused { reason } => RolloutState::Paused {
                wave,
                reason: match reason {
                    StoredPause::Gate { breach } => PauseReason::Gate(breach),
                    StoredPause::Manual => PauseReason::Manual,
                    StoredPause::Approval => PauseReason::Approval,
                    StoredPause::Timed { until } => PauseReason::Timed {
                        until: now + (until - wall).to_std().unwrap_or_default(),
                    },
                },
            },
            StoredState::Completed => RolloutState::Completed,
            StoredState::Aborted => RolloutState::Aborted,
        };
        Ok(Self {
            spec: RolloutSpec {
                waves: stored.waves,
            },
            counts: stored.counts,
            waived: stored.waived,
            state,
            current: stored.current,
            author: stored.author,
            approvals: stored.approvals,
            early: stored.early,
        })
    }
}

/// The wall-clock time of `at`, given that `now` is `wall`.
fn wall_at(at: Instant, now: Instant, wall: DateTime<Utc>) -> DateTime<Utc> {
    let ahead = chrono::Duration::from_std(at.saturating_duration_since(now)).unwrap_or_default();
    wall.checked_add_signed(ahead).unwrap_or(wall)
}

/// A stored rollout that does not hold together (a row written by hand,
/// or by a newer server).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a stored rollout with {waves} waves has {counts} wave counts and current wave {current}")]
pub struct RestoreError {
    waves: usize,
    counts: usize,
    current: usize,
}

/// A rollout as its run row keeps it (JSON): its waves, counts, waivers,
/// state, author, approvals and the pushes marked ahead of their wave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRollout {
    pub waves: Vec<WaveSpec>,
    pub counts: Vec<WaveCounts>,
    pub waived: Vec<bool>,
    /// The wave running, or the last one started.
    pub current: usize,
    pub state: StoredState,
    pub author: Option<String>,
    pub approvals: Vec<Approval>,
    /// Absent in rows written before pushes were marked ahead of a wave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early: Option<EarlyPushes>,
}

/// [`RolloutState`] as stored; its wave is [`StoredRollout::current`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "is", rename_all = "snake_case")]
pub enum StoredState {
    Running,
    Paused { reason: StoredPause },
    Completed,
    Aborted,
}

/// [`PauseReason`] as stored: a timed pause's end on the wall clock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StoredPause {
    Gate { breach: Breach },
    Manual,
    Approval,
    Timed { until: DateTime<Utc> },
}

impl StoredPause {
    /// `reason` as stored, at `now` (`wall` on the clock).
    pub fn of(reason: PauseReason, now: Instant, wall: DateTime<Utc>) -> Self {
        match reason {
            PauseReason::Gate(breach) => StoredPause::Gate { breach },
            PauseReason::Manual => StoredPause::Manual,
            PauseReason::Approval => StoredPause::Approval,
            PauseReason::Timed { until } => StoredPause::Timed {
                until: wall_at(until, now, wall),
            },
        }
    }
}

/// Wave `wave`'s counts as the API and the events show them.
pub fn wave_view(wave: usize, counts: &WaveCounts, state: WaveState) -> WaveView {
    WaveView {
        index: wave as u32,
        size: counts.size,
        provisioned: counts.provisioned,
        failed: counts.failed,
        skipped: counts.skipped,
        already_converged: counts.already_converged,
        superseded: counts.superseded,
        state,
    }
}

/// A pause in or after wave `wave`, as the API and `rollout.paused` show
/// it: the gate and its figures for a gate pause.
pub fn paused_view(wave: usize, reason: &StoredPause) -> PausedView {
    let mut view = PausedView {
        wave: wave as u32,
        reason: String::new(),
        gate: None,
        limit: None,
        observed: None,
        until: None,
    };
    let reason = match reason {
        StoredPause::Gate { breach } => {
            view.gate = Some(breach.gate.as_str().to_owned());
            view.limit = Some(breach.limit);
            view.observed = Some(breach.observed);
            "gate"
        }
        StoredPause::Manual => "manual",
        StoredPause::Approval => "approval",
        StoredPause::Timed { until } => {
            view.until = Some(*until);
            "timed"
        }
    };
    view.reason = reason.to_owned();
    view
}

impl StoredRollout {
    /// As its run row's `rollout` column holds it.
    pub fn to_json(&self) -> serde_json::Value {
        // Invariant: plain derived-`Serialize` structs with string keys,
        // which `serde_json::to_value` never refuses.
        serde_json::to_value(self).unwrap_or_else(|e| unreachable!("a stored rollout is JSON: {e}"))
    }

    /// The rollout as `GET /v1/runs/{id}` shows it.
    pub fn view(&self) -> RolloutView {
        let (name, paused) = match &self.state {
            StoredState::Running => (RolloutStateName::Running, None),
            StoredState::Paused { reason } => (RolloutStateName::Paused, Some(reason)),
            StoredState::Completed => (RolloutStateName::Completed, None),
            StoredState::Aborted => (RolloutStateName::Aborted, None),
        };
        let waves = self
            .counts
            .iter()
            .enumerate()
            .map(|(index, counts)| {
                let state = if counts.is_done() && index <= self.current {
                    WaveState::Completed
                } else if index > self.current {
                    match self.state {
                        StoredState::Aborted => WaveState::Aborted,
                        StoredState::Running
                        | StoredState::Paused { .. }
                        | StoredState::Completed => WaveState::Pending,
                    }
                } else {
                    match self.state {
                        StoredState::Running | StoredState::Completed => WaveState::Running,
                        StoredState::Paused { .. } | StoredState::Aborted => WaveState::Paused,
                    }
                };
                wave_view(index, counts, state)
            })
            .collect();
        let wave = self.current as u32;
        let paused = paused.map(|reason| paused_view(self.current, reason));
        RolloutView {
            state: name,
            wave,
            waves,
            paused,
            approvals: self
                .approvals
                .iter()
                .map(|a| ApprovalView {
                    wave: Some(a.wave as u32),
                    by: a.by.clone(),
                    at: a.at,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod nothing_follows_tests;
