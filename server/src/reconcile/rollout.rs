//! Staged rollouts: waves sized over the devices that need a push (never
//! over those already converged), the gates that pause a rollout when a
//! wave goes wrong, and a rollout's state through its waves, pauses,
//! approvals, resumes and aborts. Pure: time is passed in.

use std::fmt;
use std::time::{Duration, Instant};

/// Waves in one rollout, at most.
pub const MAX_WAVES: usize = 20;

/// Where a wave ends, counted over the devices that need a push:
/// cumulative, so `[1%, 10%, 100%]` is a 1 % canary, then up to 10 %,
/// then the rest.
#[derive(Debug, Clone, Copy, PartialEq)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// The next wave starts at once.
    None,
    /// The next wave starts after this long.
    For(Duration),
    /// The rollout waits for an operator's resume.
    Manual,
}

/// A failure bound: a count, or a share of the wave's devices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FailureLimit {
    Count(u64),
    Ratio(f64),
}

/// The gates of one wave; a breach pauses the rollout.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Gates {
    /// Provisioned devices over the wave's devices, at least.
    pub min_success_ratio: Option<f64>,
    /// Failed devices, at most.
    pub max_failures: Option<FailureLimit>,
}

/// One wave as asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaveSpec {
    pub size: WaveSize,
    pub pause: Pause,
    pub gates: Gates,
    /// The rollout goes past this wave only once someone other than its
    /// author approved it.
    pub approve: bool,
}

/// The waves of a rollout, checked: cumulative sizes that increase and end
/// at 100 %, ratios within [0, 1].
#[derive(Debug, Clone, PartialEq)]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaveCounts {
    /// Devices in the wave.
    pub size: u64,
    pub provisioned: u64,
    pub failed: u64,
    pub skipped: u64,
}

impl WaveCounts {
    pub fn decided(&self) -> u64 {
        self.provisioned + self.failed + self.skipped
    }

    pub fn is_done(&self) -> bool {
        self.decided() >= self.size
    }
}

/// Which gate a wave breached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateKind {
    MinSuccessRatio,
    MaxFailures,
}

impl GateKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GateKind::MinSuccessRatio => "min_success_ratio",
            GateKind::MaxFailures => "max_failures",
        }
    }
}

/// A breached gate with its figures: `limit` and `observed` in the gate's
/// own unit (a count, or a ratio of the wave's devices).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Breach {
    pub gate: GateKind,
    pub limit: f64,
    pub observed: f64,
}

/// The first gate `counts` breach for certain: a failure bound as soon as
/// failures pass it (they only grow), a success ratio as soon as it can no
/// longer be met even if every undecided device succeeds. `None` while
/// every gate can still hold.
pub fn breach(gates: &Gates, counts: &WaveCounts) -> Option<Breach> {
    if counts.size == 0 {
        return None;
    }
    let size = counts.size as f64;
    if let Some(limit) = gates.max_failures {
        let (limit, observed) = match limit {
            FailureLimit::Count(n) => (n as f64, counts.failed as f64),
            FailureLimit::Ratio(r) => (r, counts.failed as f64 / size),
        };
        if observed > limit {
            return Some(Breach {
                gate: GateKind::MaxFailures,
                limit,
                observed,
            });
        }
    }
    if let Some(limit) = gates.min_success_ratio {
        let undecided = counts.size.saturating_sub(counts.decided());
        let best = (counts.provisioned + undecided) as f64 / size;
        if best < limit {
            return Some(Breach {
                gate: GateKind::MinSuccessRatio,
                limit,
                // The ratio as it stands when the breach is certain.
                observed: counts.provisioned as f64 / size,
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
}

/// One rollout: its waves over the devices that needed a push when it
/// started, their counts, and where it stands.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    spec: RolloutSpec,
    ends: Vec<u64>,
    counts: Vec<WaveCounts>,
    /// Waves whose breached gate an operator resumed past: not evaluated
    /// again (its failures only grow, so it would pause at every outcome).
    waived: Vec<bool>,
    state: RolloutState,
}

impl Rollout {
    /// A rollout of `spec` over `needing` devices, its first non-empty
    /// wave started (or completed at once when nothing needs a push).
    pub fn start(spec: RolloutSpec, needing: u64) -> (Self, Vec<Transition>) {
        let ends = spec.ends(needing);
        let counts = ends
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
        let waived = vec![false; ends.len()];
        let mut rollout = Self {
            spec,
            ends,
            counts,
            waived,
            state: RolloutState::Running { wave: 0 },
        };
        let mut out = vec![Transition::WaveStarted { wave: 0 }];
        rollout.settle(0, None, &mut out);
        (rollout, out)
    }

    pub fn state(&self) -> RolloutState {
        self.state
    }

    pub fn counts(&self) -> &[WaveCounts] {
        &self.counts
    }

    /// The wave of the device at `index` among those needing a push (in
    /// the order the waves take them).
    pub fn wave_of(&self, index: u64) -> usize {
        self.ends
            .iter()
            .position(|end| index < *end)
            .unwrap_or(self.ends.len().saturating_sub(1))
    }

    /// The devices (by index among those needing a push) that may have
    /// been pushed by now: every one up to the running wave's end, so a
    /// resume after a gate paused a wave midway lets its rest go with the
    /// next wave; none more while paused or ended.
    pub fn pushable(&self) -> std::ops::Range<u64> {
        match self.state {
            RolloutState::Running { wave } => 0..self.ends[wave],
            RolloutState::Paused { .. } | RolloutState::Completed | RolloutState::Aborted => 0..0,
        }
    }

    /// A device of wave `wave` ended (a retry inside the wave is the same
    /// device, recorded once, when it ends). Returns what followed.
    pub fn record(&mut self, wave: usize, outcome: WaveOutcome, now: Instant) -> Vec<Transition> {
        let mut out = Vec::new();
        let Some(counts) = self.counts.get_mut(wave) else {
            return out;
        };
        match outcome {
            WaveOutcome::Provisioned => counts.provisioned += 1,
            WaveOutcome::Failed => counts.failed += 1,
            WaveOutcome::Skipped => counts.skipped += 1,
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

    /// Someone other than the author approved the wave it waits on.
    pub fn approve(&mut self, now: Instant) -> Result<Vec<Transition>, NotNow> {
        match self.state {
            RolloutState::Paused {
                wave,
                reason: PauseReason::Approval,
            } => {
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
            self.state = RolloutState::Completed;
            out.push(Transition::Completed);
            return;
        }
        if self.spec.waves[wave].approve {
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
        let reason = match (self.spec.waves[wave].pause, now) {
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

    fn next_wave(&mut self, wave: usize, now: Option<Instant>, out: &mut Vec<Transition>) {
        let next = wave + 1;
        if next >= self.counts.len() {
            self.state = RolloutState::Completed;
            out.push(Transition::Completed);
            return;
        }
        self.state = RolloutState::Running { wave: next };
        out.push(Transition::WaveStarted { wave: next });
        self.settle(next, now, out);
    }
}

/// How a device of a wave ended, as the gates count it: `provisioned` only
/// when its confirming report matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaveOutcome {
    Provisioned,
    Failed,
    Skipped,
}

#[cfg(test)]
mod tests;
