//! What a staged rollout is asked to do: its waves (sized over the devices
//! that need a push), the gates and pauses between them, the checks on a
//! requested rollout, and the assignment of targets to waves.

use std::fmt;

use super::*;

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
    pub(super) waves: Vec<WaveSpec>,
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
