//! Staged rollouts: waves sized over the devices that need a push (never
//! over those already converged), the gates that pause a rollout when a
//! wave goes wrong, and a rollout's state through its waves, pauses,
//! approvals, resumes and aborts, and its stored form (restored after a
//! restart) and API view. Pure: time is passed in.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use idem_protocol::api::{
    ApprovalView, PausedView, RolloutStateName, RolloutView, WaveState, WaveView,
};
use serde::{Deserialize, Serialize};

use super::outcome::OutcomeKind;

mod gates;
mod spec;
mod stored;

pub use gates::*;
pub use spec::*;
pub use stored::*;

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
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod nothing_follows_tests;
