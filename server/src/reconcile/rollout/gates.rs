//! A wave's counts and the gates they are judged by: which limit a wave
//! breached, if any.

use super::*;

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

    pub(super) fn add(&mut self, outcome: OutcomeKind) {
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
