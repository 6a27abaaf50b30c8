//! Fleet plans: "N devices, K drifted, R rejecting, S silent" turned into
//! device configs plus the ground truth — the outcome the server must reach
//! for each device. Deterministic for a given seed; pure, no IO.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use idem_protocol::{DeviceId, Health, OutcomeCounts, OutcomeKind, SpecDigest};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::behaviour::DeviceBehaviour;
use crate::config::SimDevice;
use crate::error::PlanError;

/// Default reason given by rejecting devices.
pub const DEFAULT_REJECT_MESSAGE: &str = "simulated rejection: config refused by device";

/// The outcome a correct server reaches for a planned device in the first run
/// after registration with the plan's desired spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpectedOutcome {
    /// Reports the desired spec already: nothing may be pushed.
    AlreadyConverged,
    /// Reports another spec and accepts the push.
    Provisioned,
    /// Rejects the push, never answers it, or never reports at all.
    Failed,
}

impl ExpectedOutcome {
    /// The server's outcome kind this ground truth names.
    pub fn kind(self) -> OutcomeKind {
        match self {
            ExpectedOutcome::AlreadyConverged => OutcomeKind::AlreadyConverged,
            ExpectedOutcome::Provisioned => OutcomeKind::Provisioned,
            ExpectedOutcome::Failed => OutcomeKind::Failed,
        }
    }

    /// Snake-case name, as used in the server's API and event types.
    pub fn as_str(self) -> &'static str {
        self.kind().as_str()
    }
}

impl fmt::Display for ExpectedOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-outcome device counts of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct ExpectedCounts {
    pub already_converged: usize,
    pub provisioned: usize,
    pub failed: usize,
}

impl ExpectedCounts {
    /// `N already converged, N provisioned, N failed`, with thousands
    /// separators, in the order of the server's run summary.
    pub fn summary(&self) -> String {
        OutcomeCounts {
            already_converged: self.already_converged as u64,
            provisioned: self.provisioned as u64,
            failed: self.failed as u64,
            ..OutcomeCounts::default()
        }
        .summary()
    }
}

impl fmt::Display for ExpectedCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())
    }
}

/// `9996` → `9,996` (the server's own formatting).
pub use idem_protocol::outcome::with_thousands as format_count;

/// A small, realistic desired spec used when the caller gives none.
pub fn default_desired_spec() -> Value {
    json!({
        "firmware": "2.4.1",
        "version": "2025.1",
        "telemetry": {"interval_s": 60, "metrics": ["temp", "rssi"]},
        "features": {"ota": true, "debug_log": false}
    })
}

/// A spec that differs from `desired` (by digest) the way a real drifted device
/// does: same shape, other `version`. Non-object specs get wrapped.
pub fn drifted_spec(desired: &Value) -> Value {
    let drifted = match desired {
        Value::Object(map) => {
            let mut map = map.clone();
            let version = match map.get("version") {
                Some(Value::String(v)) => format!("{v}-drifted"),
                Some(_) | None => "drifted".to_owned(),
            };
            map.insert("version".to_owned(), Value::String(version));
            Value::Object(map)
        }
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) | Value::Array(_) => {
            json!({"version": "drifted", "was": desired})
        }
    };
    if SpecDigest::of(&drifted) == SpecDigest::of(desired) {
        // Only reachable if `version` was already "drifted"-like in a way that
        // round-trips; wrap to guarantee a different digest.
        json!({"version": "drifted", "was": desired})
    } else {
        drifted
    }
}

/// The role a plan gives one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Converged,
    Drifted,
    Rejecting,
    Silent,
    Ignoring,
}

/// Builder for a fleet with a known mix of device states and behaviours.
///
/// `drifted`, `rejecting`, `silent` and `ignoring_pushes` pick **disjoint**
/// sets of devices (chosen from `seed`); every other device runs the desired
/// spec already. Rejecting and ignoring devices also start off the desired
/// spec, so the server has to push to them and they end `Failed`. Silent
/// devices never report, so they end `Failed` by timeout whatever they run.
#[derive(Debug, Clone)]
pub struct FleetPlan {
    prefix: String,
    devices: usize,
    desired_spec: Value,
    drifted: usize,
    rejecting: usize,
    silent: usize,
    ignoring: usize,
    seed: u64,
    initial_generation: Option<u64>,
    reject_message: String,
    apply_latency: (Duration, Duration),
    health: Health,
}

impl FleetPlan {
    /// `devices` devices named `{prefix}{index}` (index zero-padded to at
    /// least 5 digits), all accepting and already on the default desired spec.
    pub fn new(prefix: impl Into<String>, devices: usize) -> Self {
        Self {
            prefix: prefix.into(),
            devices,
            desired_spec: default_desired_spec(),
            drifted: 0,
            rejecting: 0,
            silent: 0,
            ignoring: 0,
            seed: 0,
            initial_generation: Some(1),
            reject_message: DEFAULT_REJECT_MESSAGE.to_owned(),
            apply_latency: (Duration::ZERO, Duration::ZERO),
            health: Health::Healthy,
        }
    }

    pub fn desired_spec(mut self, spec: Value) -> Self {
        self.desired_spec = spec;
        self
    }

    /// Devices that start on another spec and accept the push.
    pub fn drifted(mut self, n: usize) -> Self {
        self.drifted = n;
        self
    }

    /// Devices that start on another spec and reject every push.
    pub fn rejecting(mut self, n: usize) -> Self {
        self.rejecting = n;
        self
    }

    /// Devices that never report nor answer.
    pub fn silent(mut self, n: usize) -> Self {
        self.silent = n;
        self
    }

    /// Devices that start on another spec, report, but ignore pushes.
    pub fn ignoring_pushes(mut self, n: usize) -> Self {
        self.ignoring = n;
        self
    }

    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Generation reported by devices already on the desired spec (default
    /// `Some(1)`: the generation the server assigns at registration).
    pub fn initial_generation(mut self, generation: Option<u64>) -> Self {
        self.initial_generation = generation;
        self
    }

    pub fn reject_message(mut self, message: impl Into<String>) -> Self {
        self.reject_message = message.into();
        self
    }

    /// Every device's apply latency, drawn uniformly (from the seed) in
    /// `min..=max`.
    pub fn apply_latency(mut self, min: Duration, max: Duration) -> Self {
        self.apply_latency = (min, max);
        self
    }

    pub fn health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    /// The device configs and their expected outcomes.
    pub fn build(&self) -> Result<Plan, PlanError> {
        let requested = self.drifted + self.rejecting + self.silent + self.ignoring;
        if requested > self.devices {
            return Err(PlanError::TooManySpecial {
                requested,
                devices: self.devices,
            });
        }
        let (min_latency, max_latency) = self.apply_latency;
        if min_latency > max_latency {
            return Err(PlanError::InvertedLatency {
                min: min_latency,
                max: max_latency,
            });
        }
        let width = self.devices.saturating_sub(1).to_string().len().max(5);
        let mut rng = StdRng::seed_from_u64(self.seed);

        let mut roles = Vec::with_capacity(self.devices);
        roles.extend(std::iter::repeat_n(Role::Drifted, self.drifted));
        roles.extend(std::iter::repeat_n(Role::Rejecting, self.rejecting));
        roles.extend(std::iter::repeat_n(Role::Silent, self.silent));
        roles.extend(std::iter::repeat_n(Role::Ignoring, self.ignoring));
        roles.resize(self.devices, Role::Converged);
        roles.shuffle(&mut rng);

        let drifted = drifted_spec(&self.desired_spec);
        let mut devices = Vec::with_capacity(self.devices);
        let mut expected = BTreeMap::new();
        for (index, role) in roles.into_iter().enumerate() {
            let raw = format!("{}{index:0width$}", self.prefix);
            let id = DeviceId::parse(&raw).map_err(|source| PlanError::InvalidPrefix {
                prefix: self.prefix.clone(),
                source,
            })?;
            let latency = if min_latency == max_latency {
                min_latency
            } else {
                rng.random_range(min_latency..=max_latency)
            };
            let base = SimDevice::new(id.clone(), self.desired_spec.clone())
                .with_apply_latency(latency)
                .with_health(self.health);
            let (device, outcome) = match role {
                Role::Converged => (
                    base.with_generation(self.initial_generation),
                    ExpectedOutcome::AlreadyConverged,
                ),
                Role::Drifted => (drift(base, &drifted), ExpectedOutcome::Provisioned),
                Role::Rejecting => (
                    drift(base, &drifted).with_behaviour(DeviceBehaviour::Reject {
                        message: self.reject_message.clone(),
                    }),
                    ExpectedOutcome::Failed,
                ),
                Role::Silent => (
                    base.with_generation(self.initial_generation)
                        .with_behaviour(DeviceBehaviour::Silent),
                    ExpectedOutcome::Failed,
                ),
                Role::Ignoring => (
                    drift(base, &drifted).with_behaviour(DeviceBehaviour::IgnorePushes),
                    ExpectedOutcome::Failed,
                ),
            };
            expected.insert(id, outcome);
            devices.push(device);
        }
        Ok(Plan {
            desired_spec: self.desired_spec.clone(),
            devices,
            expected,
        })
    }
}

fn drift(device: SimDevice, drifted: &Value) -> SimDevice {
    SimDevice {
        spec: drifted.clone(),
        generation: None,
        ..device
    }
}

/// A built plan: device configs and the ground truth for each.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The spec the server should be told to want for every device.
    pub desired_spec: Value,
    pub devices: Vec<SimDevice>,
    pub expected: BTreeMap<DeviceId, ExpectedOutcome>,
}

impl Plan {
    pub fn expected(&self, id: &DeviceId) -> Option<ExpectedOutcome> {
        self.expected.get(id).copied()
    }

    pub fn expected_counts(&self) -> ExpectedCounts {
        let mut counts = ExpectedCounts::default();
        for outcome in self.expected.values() {
            match outcome {
                ExpectedOutcome::AlreadyConverged => counts.already_converged += 1,
                ExpectedOutcome::Provisioned => counts.provisioned += 1,
                ExpectedOutcome::Failed => counts.failed += 1,
            }
        }
        counts
    }

    /// Ids expected to end with `outcome`, sorted.
    pub fn ids_expecting(&self, outcome: ExpectedOutcome) -> Vec<DeviceId> {
        self.expected
            .iter()
            .filter(|(_, o)| **o == outcome)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Devices whose `actual` outcome differs from the ground truth, as
    /// `(id, expected, actual)`; a device missing from `actual` counts as a
    /// mismatch with `None`. Ids in `actual` that the plan does not know are
    /// ignored.
    pub fn mismatches<'a>(
        &'a self,
        actual: &BTreeMap<DeviceId, ExpectedOutcome>,
    ) -> Vec<(&'a DeviceId, ExpectedOutcome, Option<ExpectedOutcome>)> {
        self.expected
            .iter()
            .filter_map(|(id, want)| {
                let got = actual.get(id).copied();
                (got != Some(*want)).then_some((id, *want, got))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_of_10000_with_4_drifted_expects_9996_converged_and_4_provisioned() {
        let plan = FleetPlan::new("sim-", 10_000).drifted(4).build().unwrap();
        assert_eq!(plan.devices.len(), 10_000);
        assert_eq!(
            plan.expected_counts().summary(),
            "9,996 already converged, 4 provisioned, 0 failed"
        );
    }

    #[test]
    fn drifted_devices_run_another_spec_and_the_rest_run_the_desired_one() {
        let plan = FleetPlan::new("d-", 50).drifted(4).seed(7).build().unwrap();
        let desired = SpecDigest::of(&plan.desired_spec);
        for device in &plan.devices {
            let same = SpecDigest::of(&device.spec) == desired;
            match plan.expected(&device.id).unwrap() {
                ExpectedOutcome::AlreadyConverged => {
                    assert!(same);
                    assert_eq!(device.generation, Some(1));
                }
                ExpectedOutcome::Provisioned => {
                    assert!(!same);
                    assert_eq!(device.generation, None);
                }
                ExpectedOutcome::Failed => panic!("no failing devices were planned"),
            }
            assert_eq!(device.behaviour, DeviceBehaviour::Accept);
        }
    }

    #[test]
    fn rejecting_silent_and_ignoring_devices_are_expected_to_fail() {
        let plan = FleetPlan::new("d-", 100)
            .drifted(5)
            .rejecting(2)
            .silent(3)
            .ignoring_pushes(1)
            .build()
            .unwrap();
        let counts = plan.expected_counts();
        assert_eq!(
            counts,
            ExpectedCounts {
                already_converged: 89,
                provisioned: 5,
                failed: 6
            }
        );
        let desired = SpecDigest::of(&plan.desired_spec);
        for device in &plan.devices {
            let expected = plan.expected(&device.id).unwrap();
            match &device.behaviour {
                DeviceBehaviour::Reject { message } => {
                    assert_eq!(message, DEFAULT_REJECT_MESSAGE);
                    assert_ne!(SpecDigest::of(&device.spec), desired, "must be pushed to");
                    assert_eq!(expected, ExpectedOutcome::Failed);
                }
                DeviceBehaviour::Silent => {
                    assert!(!device.reports_on_connect());
                    assert_eq!(expected, ExpectedOutcome::Failed);
                }
                DeviceBehaviour::IgnorePushes => {
                    assert_ne!(SpecDigest::of(&device.spec), desired, "must be pushed to");
                    assert_eq!(expected, ExpectedOutcome::Failed);
                }
                DeviceBehaviour::Accept => assert_ne!(expected, ExpectedOutcome::Failed),
                DeviceBehaviour::RejectTimes { .. } => panic!("not planned"),
            }
        }
    }

    #[test]
    fn the_same_seed_picks_the_same_devices_and_another_seed_others() {
        let pick = |seed| {
            FleetPlan::new("d-", 1000)
                .drifted(10)
                .seed(seed)
                .build()
                .unwrap()
                .ids_expecting(ExpectedOutcome::Provisioned)
        };
        assert_eq!(pick(42), pick(42));
        assert_ne!(pick(42), pick(43));
    }

    #[test]
    fn ids_are_prefixed_zero_padded_and_unique() {
        let plan = FleetPlan::new("sim-", 3).build().unwrap();
        let ids: Vec<&str> = plan.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["sim-00000", "sim-00001", "sim-00002"]);
        let big = FleetPlan::new("x", 100_001).build().unwrap();
        assert_eq!(big.devices[100_000].id.as_str(), "x100000");
        assert_eq!(big.expected.len(), 100_001);
    }

    #[test]
    fn a_plan_asking_for_more_special_devices_than_exist_is_refused() {
        let err = FleetPlan::new("d-", 5)
            .drifted(3)
            .rejecting(3)
            .build()
            .unwrap_err();
        assert_eq!(
            err,
            PlanError::TooManySpecial {
                requested: 6,
                devices: 5
            }
        );
    }

    #[test]
    fn a_prefix_that_makes_invalid_ids_is_refused() {
        let err = FleetPlan::new("bad/", 1).build().unwrap_err();
        assert!(matches!(err, PlanError::InvalidPrefix { .. }), "{err:?}");
    }

    #[test]
    fn apply_latencies_fall_in_the_requested_range() {
        let (min, max) = (Duration::from_millis(10), Duration::from_millis(50));
        let plan = FleetPlan::new("d-", 200)
            .apply_latency(min, max)
            .build()
            .unwrap();
        assert!(plan
            .devices
            .iter()
            .all(|d| d.apply_latency >= min && d.apply_latency <= max));
        assert!(plan.devices.iter().any(|d| d.apply_latency != min));
        let inverted = FleetPlan::new("d-", 1).apply_latency(max, min).build();
        assert!(matches!(inverted, Err(PlanError::InvertedLatency { .. })));
    }

    #[test]
    fn a_drifted_spec_always_has_another_digest() {
        for desired in [
            default_desired_spec(),
            json!({}),
            json!({"version": 3}),
            json!([1, 2]),
            json!("x"),
            json!(null),
        ] {
            assert_ne!(
                SpecDigest::of(&drifted_spec(&desired)),
                SpecDigest::of(&desired),
                "{desired}"
            );
        }
    }

    #[test]
    fn the_checker_names_devices_whose_outcome_differs_from_the_ground_truth() {
        let plan = FleetPlan::new("d-", 10).drifted(2).seed(1).build().unwrap();
        let mut actual = plan.expected.clone();
        assert!(plan.mismatches(&actual).is_empty());
        let provisioned = plan.ids_expecting(ExpectedOutcome::Provisioned);
        actual.insert(provisioned[0].clone(), ExpectedOutcome::AlreadyConverged);
        let converged = plan.ids_expecting(ExpectedOutcome::AlreadyConverged);
        actual.remove(&converged[0]);
        let mismatches = plan.mismatches(&actual);
        assert_eq!(mismatches.len(), 2);
        assert!(mismatches.contains(&(
            &provisioned[0],
            ExpectedOutcome::Provisioned,
            Some(ExpectedOutcome::AlreadyConverged)
        )));
        assert!(mismatches.contains(&(&converged[0], ExpectedOutcome::AlreadyConverged, None)));
    }
}
