//! Staged rollouts as the API writes them: the `rollout` a desired change
//! or a plan's apply asks for (waves, pauses, gates, approvals), a
//! rollout's waves and state in `GET /v1/runs/{id}`, and the answers of
//! `POST /v1/rollouts/{run_id}/resume|abort|approve`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// `rollout` of `POST /v1/desired` and `POST /v1/plans/{id}/apply`: the
/// waves, each a size (`"1%"`, `10`) or an object with its own pause,
/// gates and approval; `pause` and `gates` here apply to every wave that
/// does not give its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutRequest {
    pub waves: Vec<WaveRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gates: Option<GatesRequest>,
}

/// One wave: just its size, or its size with what follows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WaveRequest {
    Size(WaveSizeRequest),
    Detailed(WaveDetail),
}

/// A wave's cumulative size among the devices that need a push: a count
/// (`10`) or a percentage (`"10%"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WaveSizeRequest {
    Count(u64),
    Text(String),
}

/// A wave with its own pause, gates and approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaveDetail {
    pub size: WaveSizeRequest,
    /// After the wave: a duration (`"10m"`), `"manual"` (wait for a
    /// resume), or `"0s"` (go on at once, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gates: Option<GatesRequest>,
    /// The rollout goes past this wave only once a token other than its
    /// author's approved it.
    #[serde(default, skip_serializing_if = "super::is_false")]
    pub approve: bool,
}

/// A wave's gates; a breach pauses the rollout at once.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatesRequest {
    /// Devices that end matching their target over the wave's devices, at
    /// least (within [0, 1]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_success_ratio: Option<f64>,
    /// Failed devices in the wave, at most (a count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failures: Option<u64>,
    /// Failed devices over the wave's devices, at most (within [0, 1]);
    /// not together with `max_failures`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failure_ratio: Option<f64>,
}

/// Where a rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RolloutStateName {
    Running,
    Paused,
    Completed,
    Aborted,
}

/// Where one wave stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum WaveState {
    /// Not started yet.
    Pending,
    Running,
    /// Stopped by a breached gate (or an operator's abort) before its
    /// last device had its outcome.
    Paused,
    /// Its every device has its outcome.
    Completed,
    /// The rollout was aborted before the wave started.
    Aborted,
}

/// One wave of a rollout in `GET /v1/runs/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WaveView {
    pub index: u32,
    /// Devices in the wave (of those that needed a push at the start).
    pub size: u64,
    pub provisioned: u64,
    pub failed: u64,
    pub skipped: u64,
    /// Devices of the wave that matched before their push was due.
    pub already_converged: u64,
    /// Devices of the wave a newer desired change took over.
    pub superseded: u64,
    pub state: WaveState,
}

/// Why a rollout is paused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PausedView {
    /// The wave it paused in (a gate) or after.
    pub wave: u32,
    /// `gate`, `manual`, `approval` or `timed`.
    pub reason: String,
    /// The breached gate (`min_success_ratio`, `max_failures`,
    /// `max_failure_ratio`) and its figures, for a gate pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<f64>,
    /// When a timed pause ends by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<DateTime<Utc>>,
}

/// An approval of a rollout wave or a plan, as the run records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApprovalView {
    /// The wave approved; absent for a plan's approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave: Option<u32>,
    /// The approving token's name.
    pub by: String,
    pub at: DateTime<Utc>,
}

/// A rollout in `GET /v1/runs/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RolloutView {
    pub state: RolloutStateName,
    /// The wave running, or the last one started.
    pub wave: u32,
    pub waves: Vec<WaveView>,
    pub paused: Option<PausedView>,
    pub approvals: Vec<ApprovalView>,
}

/// The answer of `POST /v1/rollouts/{run_id}/resume`, `…/abort` and
/// `…/approve`: the rollout as it stands after the action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RolloutActed {
    pub run_id: Uuid,
    pub rollout: RolloutView,
}

/// Waves in one rollout, at most (the server refuses more).
pub const MAX_WAVES: usize = 20;

/// A wave percentage as text: `"1%"`, `"12.5%"`, `"100%"`.
pub const WAVE_PERCENT_PATTERN: &str = r"^(100|[0-9]{1,2}(\.[0-9]{1,3})?)%$";

/// A pause after a wave: `"manual"`, or a duration such as `"10m"`.
pub const PAUSE_PATTERN: &str = r"^(manual|[0-9]{1,9}(ms|s|m|h|d)?)$";

#[cfg(feature = "openapi")]
pub mod schema {
    use utoipa::openapi::schema::{
        AdditionalProperties, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type,
    };
    use utoipa::openapi::RefOr;

    use super::{MAX_WAVES, PAUSE_PATTERN, WAVE_PERCENT_PATTERN};

    fn ratio() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::Number)
            .minimum(Some(0.0))
            .maximum(Some(1.0))
            .into()
    }

    fn size() -> Schema {
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(1.0)),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(WAVE_PERCENT_PATTERN)),
            )
            .into()
    }

    fn pause() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(PAUSE_PATTERN))
            .description(Some(
                "after the wave: a duration (`10m`) before the next starts, or `manual` (wait for POST /v1/rollouts/{run_id}/resume)",
            ))
            .into()
    }

    fn gates() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("min_success_ratio", ratio())
            .property(
                "max_failures",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(0.0)),
            )
            .property("max_failure_ratio", ratio())
            .description(Some(
                "at most one of `max_failures` (a count) and `max_failure_ratio`",
            ))
            .additional_properties(Some(AdditionalProperties::FreeForm(false)))
            .into()
    }

    fn wave() -> Schema {
        let detailed = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("size", size())
            .required("size")
            .property("pause", pause())
            .property("gates", gates())
            .property("approve", ObjectBuilder::new().schema_type(Type::Boolean))
            .additional_properties(Some(AdditionalProperties::FreeForm(false)));
        OneOfBuilder::new().item(size()).item(detailed).into()
    }

    /// `rollout` of `POST /v1/desired`.
    pub fn rollout() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "waves",
                ArrayBuilder::new()
                    .items(RefOr::T(wave()))
                    .min_items(Some(1))
                    .max_items(Some(MAX_WAVES)),
            )
            .required("waves")
            .property("pause", pause())
            .property("gates", gates())
            .description(Some(
                "staged waves over the devices that need a push: cumulative sizes that increase, counts before percentages, the last \"100%\"",
            ))
            .additional_properties(Some(AdditionalProperties::FreeForm(false)))
            .into()
    }
}
