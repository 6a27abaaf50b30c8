//! A rollout's stored form (its run row keeps it, and a restart restores
//! it) and the API's view of it.

use super::*;

impl Rollout {
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
