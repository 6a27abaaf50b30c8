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
/// does not give its own (`pause` to every wave but the last: nothing
/// follows the last wave, and a pause or an approval it asks for itself is
/// refused).
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
    Count(#[serde(deserialize_with = "whole::number")] u64),
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
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::optional"
    )]
    pub max_failures: Option<u64>,
    /// Failed devices over the wave's devices, at most (within [0, 1]);
    /// not together with `max_failures`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failure_ratio: Option<f64>,
}

/// The largest count a wave size or a gate takes (the largest whole
/// number every JSON reader holds exactly).
pub const MAX_COUNT: u64 = 9_007_199_254_740_991;

/// Counts as JSON may write them: `10`, or `10.0` (JSON Schema calls that
/// an integer too), never `10.5` or a negative number.
mod whole {
    use serde::de::{self, Deserializer, Visitor};
    use std::fmt;

    struct Whole;

    impl Visitor<'_> for Whole {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a whole number from 0 to 2^53 - 1")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            if v <= super::MAX_COUNT {
                Ok(v)
            } else {
                Err(E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            match u64::try_from(v) {
                Ok(v) => self.visit_u64(v),
                Err(_) => Err(E::invalid_value(de::Unexpected::Signed(v), &self)),
            }
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
            // Up to MAX_COUNT (2^53 - 1) every whole f64 is exact.
            if v.fract() == 0.0 && (0.0..=super::MAX_COUNT as f64).contains(&v) {
                Ok(v as u64)
            } else {
                Err(E::invalid_value(de::Unexpected::Float(v), &self))
            }
        }
    }

    pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(Whole)
    }

    pub fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        struct Optional;
        impl<'de> Visitor<'de> for Optional {
            type Value = Option<u64>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number of at least 0, or null")
            }
            fn visit_none<E: de::Error>(self) -> Result<Option<u64>, E> {
                Ok(None)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
                Ok(None)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
                number(d).map(Some)
            }
        }
        d.deserialize_option(Optional)
    }
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

    use super::{MAX_COUNT, MAX_WAVES, PAUSE_PATTERN, WAVE_PERCENT_PATTERN};
    use crate::api::bounds::schema::{not_both, rule};

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
                    .minimum(Some(1.0))
                    .maximum(Some(MAX_COUNT as f64)),
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
                    .minimum(Some(0.0))
                    .maximum(Some(MAX_COUNT as f64)),
            )
            .property("max_failure_ratio", ratio())
            .description(Some(
                "at most one of `max_failures` (a count) and `max_failure_ratio`",
            ))
            .extensions(Some(not_both("max_failures", "max_failure_ratio")))
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

    /// `rollout` of `POST /v1/desired` and `POST /v1/plans/{id}/apply`,
    /// or `null` (no waves: every device at once).
    pub fn optional_rollout() -> Schema {
        OneOfBuilder::new()
            .item(rollout())
            .item(ObjectBuilder::new().schema_type(Type::Null))
            .into()
    }

    /// `rollout` of `POST /v1/desired` and `POST /v1/plans/{id}/apply`.
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
            .extensions(Some(rule(
                "wave sizes are cumulative and strictly increase; every count comes before every percentage; the last wave is \"100%\"; otherwise 400 invalid_rollout",
            )))
            .additional_properties(Some(AdditionalProperties::FreeForm(false)))
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_count_written_as_a_whole_float_is_a_count_and_a_fraction_or_negative_is_refused() {
        let request: RolloutRequest = serde_json::from_value(json!({
            "waves": [10.0, {"size": 20.0}, "100%"],
            "gates": {"max_failures": 2.0},
        }))
        .unwrap();
        assert_eq!(
            request.waves[0],
            WaveRequest::Size(WaveSizeRequest::Count(10))
        );
        assert_eq!(request.gates.unwrap().max_failures, Some(2));
        let too_big = json!({"waves": [MAX_COUNT + 1]});
        for bad in [json!({"waves": [1.5]}), json!({"waves": [-1]}), too_big] {
            assert!(
                serde_json::from_value::<RolloutRequest>(bad.clone()).is_err(),
                "{bad}"
            );
        }
        let bad_gate = json!({"waves": ["100%"], "gates": {"max_failures": 2.5}});
        assert!(serde_json::from_value::<RolloutRequest>(bad_gate).is_err());
        let no_gate = json!({"waves": ["100%"], "gates": {"max_failures": null}});
        let request: RolloutRequest = serde_json::from_value(no_gate).unwrap();
        assert_eq!(request.gates.unwrap().max_failures, None);
    }
}
