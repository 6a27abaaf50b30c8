//! One device's attempt in flight: its [`Phase`] (the one place its timers
//! and queue state live) and how `decide` sees it.

use std::time::Instant;

use idem_protocol::Generation;
use uuid::Uuid;

use crate::reconcile::decide::Attempt;
use crate::reconcile::outcome::Outcome;

/// Where one device's attempt stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    /// Nothing sent yet in this attempt.
    Fresh,
    /// Waiting in the push queue for a pacing slot or room in flight.
    Queued,
    /// A `get` was sent; the report is due by `deadline`.
    AwaitingReport { deadline: Instant },
    /// `generation` was pushed when the device's last report had
    /// `seq_at_push`; its confirmation is due by `deadline`.
    Pushed {
        generation: Generation,
        seq_at_push: Option<u64>,
        deadline: Instant,
    },
    /// A restarted process found `generation` marked as possibly pushed
    /// ahead of its wave by the process before: an answer by `deadline`
    /// is taken as the answer to that push; without one it was not sent,
    /// and the attempt starts afresh (no failure).
    MaybePushed {
        generation: Generation,
        deadline: Instant,
    },
    /// A failed attempt waits until then before it is tried again.
    RetryAt(Instant),
    /// The device needs a push its rollout does not allow yet (a later
    /// wave, or the rollout is paused).
    Held,
}

/// One device's attempt, shared by every run that waits on it.
#[derive(Debug)]
pub(super) struct InFlight {
    pub runs: Vec<Uuid>,
    pub force: bool,
    /// Desired generation this attempt works towards.
    pub generation: Option<Generation>,
    /// When the run that started this attempt began (convergence latency).
    pub since: Instant,
    pub phase: Phase,
    /// A run waiting on it found the device's report differing from its
    /// desired spec when it was created ([`converged_in_run`]).
    pub differed: bool,
}

/// The outcome a run records for a decided attempt: a device whose report
/// differed from its desired spec when the run was created and that is
/// found converged later got there during the run (by one of its pushes,
/// perhaps one an earlier engine holder sent before it lost the engine),
/// so it is `provisioned`, never `already_converged`.
pub(super) fn converged_in_run(outcome: Outcome, differed: bool) -> Outcome {
    match outcome {
        Outcome::AlreadyConverged if differed => Outcome::Provisioned,
        Outcome::AlreadyConverged
        | Outcome::Provisioned
        | Outcome::Failed(_)
        | Outcome::Skipped(_)
        | Outcome::Superseded => outcome,
    }
}

impl InFlight {
    /// The attempt as `decide` sees it at `now`.
    pub fn attempt(&self, now: Instant) -> Attempt {
        match &self.phase {
            Phase::Fresh | Phase::Queued | Phase::RetryAt(_) | Phase::Held => {
                Attempt::Fresh { force: self.force }
            }
            Phase::AwaitingReport { deadline } => Attempt::AwaitingReport {
                expired: now >= *deadline,
            },
            Phase::Pushed {
                generation,
                seq_at_push,
                deadline,
            } => Attempt::Pushed {
                generation: *generation,
                seq_at_push: *seq_at_push,
                expired: now >= *deadline,
            },
            // Never expired: past its deadline the scan starts it afresh.
            Phase::MaybePushed { generation, .. } => Attempt::Pushed {
                generation: *generation,
                seq_at_push: None,
                expired: false,
            },
        }
    }

    /// True when a timer of this attempt has run out at `now`.
    pub fn is_due(&self, now: Instant) -> bool {
        match &self.phase {
            Phase::Fresh | Phase::Queued | Phase::Held => false,
            Phase::AwaitingReport { deadline }
            | Phase::Pushed { deadline, .. }
            | Phase::MaybePushed { deadline, .. } => now >= *deadline,
            Phase::RetryAt(at) => now >= *at,
        }
    }
}
