//! What a simulated device does with a message, as pure functions over its
//! local state: applying or rejecting a desired config, building reports and
//! choosing the first `seq`. No IO, no clock reads except [`seq_base_now`], no
//! logging — the MQTT task in `device_task` is a thin adapter around this.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idem_protocol::{Desired, Generation, Health, Rejection, Reported, SpecDigest};
use serde_json::Value;

/// How a device treats pushed configuration (and whether it talks at all).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceBehaviour {
    /// Applies every pushed config and reports it.
    #[default]
    Accept,
    /// Refuses every pushed config, reporting `message` as the reason.
    Reject { message: String },
    /// Refuses the first `times` pushes, then accepts (a flaky device).
    RejectTimes { times: u32, message: String },
    /// Reports on connect and answers `get`, but never reacts to `desired`
    /// (a device whose config agent is hung): the server must time it out.
    IgnorePushes,
    /// Connects and subscribes but never answers `desired` or `get`; by
    /// default it does not even send the initial report on connect.
    Silent,
}

impl DeviceBehaviour {
    /// Whether the device sends a report right after each (re)connect, unless
    /// the device config overrides it: every behaviour except `Silent`.
    pub fn reports_on_connect_by_default(&self) -> bool {
        !matches!(self, DeviceBehaviour::Silent)
    }

    /// Whether the device answers `{root}/{id}/get` with a report.
    pub fn answers_get(&self) -> bool {
        !matches!(self, DeviceBehaviour::Silent)
    }

    /// Whether the device reacts to `{root}/{id}/desired` at all.
    pub fn answers_desired(&self) -> bool {
        match self {
            DeviceBehaviour::Accept
            | DeviceBehaviour::Reject { .. }
            | DeviceBehaviour::RejectTimes { .. } => true,
            DeviceBehaviour::IgnorePushes | DeviceBehaviour::Silent => false,
        }
    }

    /// Whether local changes and heartbeats produce reports.
    pub fn sends_reports(&self) -> bool {
        !matches!(self, DeviceBehaviour::Silent)
    }
}

/// The local state of one simulated device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceState {
    /// The configuration the device runs now.
    pub spec: Value,
    /// The desired generation it last applied; `None` if it never applied one.
    pub generation: Option<u64>,
    /// Health included in every report.
    pub health: Health,
    /// The `seq` of the last report built; the next report uses `seq + 1`.
    pub seq: u64,
    /// Reports handed to the MQTT client.
    pub reports_sent: u64,
    /// `desired` messages received (valid ones), including ignored ones.
    pub desired_received: u64,
    /// `get` requests received.
    pub get_received: u64,
    /// Pushes this device refused.
    pub rejections: u64,
    /// The last refusal, kept for tests and demo output.
    pub last_rejection: Option<Rejection>,
    /// When the last valid `desired` message arrived. Set by the MQTT
    /// adapter (the functions here never read the clock); the demo measures
    /// convergence latency with it.
    pub desired_at: Option<Instant>,
    /// When the report confirming the last *applied* push was handed to the
    /// MQTT client. Set by the MQTT adapter, like `desired_at`.
    pub confirmed_at: Option<Instant>,
    /// Every generation whose spec the device actually installed (a changed
    /// spec), in order: what a real device would have flashed.
    pub installed: Vec<u64>,
}

impl DeviceState {
    /// A device running `spec`, last applied `generation`, whose first report
    /// will carry `seq_base + 1`.
    pub fn new(spec: Value, generation: Option<u64>, health: Health, seq_base: u64) -> Self {
        Self {
            spec,
            generation,
            health,
            seq: seq_base,
            reports_sent: 0,
            desired_received: 0,
            get_received: 0,
            rejections: 0,
            last_rejection: None,
            desired_at: None,
            confirmed_at: None,
            installed: Vec::new(),
        }
    }

    /// A report of the current state with the next `seq`.
    pub fn report(&mut self) -> Reported {
        self.report_with_error(None)
    }

    fn report_with_error(&mut self, error: Option<Rejection>) -> Reported {
        self.seq = self.seq.saturating_add(1);
        Reported {
            seq: self.seq,
            generation: self.generation.map(Generation),
            spec: self.spec.clone(),
            health: Some(self.health),
            error,
        }
    }
}

/// What a device does with one `desired` message: the report it answers with,
/// or `None` for devices that ignore pushes.
///
/// Answering devices report after **every** desired message, even one for the
/// generation they already run (the server relies on this for forced runs).
/// As `docs/PROTOCOL.md` §6.2 requires, a generation older than the applied
/// one is never applied (the device reports its state unchanged), and a spec
/// the device already runs is adopted without work (so never refused). A
/// refusal keeps the old spec and generation and carries the reason in
/// `error`. `RejectTimes` counts its earlier refusals in `state.rejections`.
pub fn respond_to_desired(
    state: &mut DeviceState,
    behaviour: &DeviceBehaviour,
    desired: &Desired,
) -> Option<Reported> {
    if !behaviour.answers_desired() {
        return None;
    }
    let pushed = desired.generation.get();
    if state.generation.is_some_and(|applied| pushed < applied) {
        return Some(state.report());
    }
    if SpecDigest::of(&desired.spec) == SpecDigest::of(&state.spec) {
        state.generation = Some(pushed);
        return Some(state.report());
    }
    let refusal = match behaviour {
        DeviceBehaviour::Accept => None,
        DeviceBehaviour::Reject { message } => Some(message),
        DeviceBehaviour::RejectTimes { times, message } => {
            (state.rejections < u64::from(*times)).then_some(message)
        }
        DeviceBehaviour::IgnorePushes | DeviceBehaviour::Silent => return None,
    };
    match refusal {
        None => {
            state.spec = desired.spec.clone();
            state.generation = Some(pushed);
            state.installed.push(pushed);
            Some(state.report())
        }
        Some(message) => {
            let rejection = Rejection {
                generation: desired.generation,
                message: message.clone(),
            };
            state.rejections = state.rejections.saturating_add(1);
            state.last_rejection = Some(rejection.clone());
            Some(state.report_with_error(Some(rejection)))
        }
    }
}

/// The `seq` base for a simulator process: the current unix time in
/// microseconds.
///
/// Why: the server drops any report whose `seq` is not above the stored one,
/// and the simulator keeps no state on disk. Starting from the clock makes a
/// restarted simulator's reports newer than everything the previous process
/// sent, as long as that process sent fewer than one report per device per
/// microsecond of its lifetime (and the clock did not step backwards).
pub fn seq_base_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn state() -> DeviceState {
        DeviceState::new(json!({"fw": "1.0"}), Some(1), Health::Healthy, 100)
    }

    fn desired(generation: u64) -> Desired {
        Desired {
            generation: Generation(generation),
            spec: json!({"fw": "2.0"}),
        }
    }

    #[test]
    fn an_accepting_device_applies_the_push_and_reports_the_new_generation() {
        let mut s = state();
        let r = respond_to_desired(&mut s, &DeviceBehaviour::Accept, &desired(2)).unwrap();
        assert_eq!(
            r,
            Reported {
                seq: 101,
                generation: Some(Generation(2)),
                spec: json!({"fw": "2.0"}),
                health: Some(Health::Healthy),
                error: None,
            }
        );
        assert_eq!(s.spec, json!({"fw": "2.0"}));
        assert_eq!(s.generation, Some(2));
        assert_eq!(s.rejections, 0);
    }

    #[test]
    fn a_rejecting_device_keeps_its_spec_and_reports_the_reason() {
        let mut s = state();
        let b = DeviceBehaviour::Reject {
            message: "flash full".into(),
        };
        let r = respond_to_desired(&mut s, &b, &desired(2)).unwrap();
        assert_eq!(r.spec, json!({"fw": "1.0"}));
        assert_eq!(r.generation, Some(Generation(1)));
        assert_eq!(
            r.error,
            Some(Rejection {
                generation: Generation(2),
                message: "flash full".into()
            })
        );
        assert_eq!(s.rejections, 1);
        assert_eq!(s.generation, Some(1));
    }

    #[test]
    fn a_flaky_device_rejects_the_first_pushes_then_accepts() {
        let mut s = state();
        let b = DeviceBehaviour::RejectTimes {
            times: 2,
            message: "busy".into(),
        };
        let outcomes: Vec<bool> = (2..=5)
            .map(|g| {
                respond_to_desired(&mut s, &b, &desired(g))
                    .unwrap()
                    .error
                    .is_none()
            })
            .collect();
        assert_eq!(outcomes, [false, false, true, true]);
        assert_eq!(s.generation, Some(5));
        assert_eq!(s.rejections, 2);
    }

    #[test]
    fn a_device_reports_again_when_pushed_the_generation_it_already_runs() {
        let mut s = state();
        let first = respond_to_desired(&mut s, &DeviceBehaviour::Accept, &desired(2)).unwrap();
        let again = respond_to_desired(&mut s, &DeviceBehaviour::Accept, &desired(2)).unwrap();
        assert_eq!(again.generation, first.generation);
        assert_eq!(again.spec, first.spec);
        assert!(again.seq > first.seq);
    }

    #[test]
    fn an_older_generation_is_never_applied() {
        let mut s = state();
        respond_to_desired(&mut s, &DeviceBehaviour::Accept, &desired(3)).unwrap();
        let older = Desired {
            generation: Generation(2),
            spec: json!({"fw": "0.9"}),
        };
        let r = respond_to_desired(&mut s, &DeviceBehaviour::Accept, &older).unwrap();
        assert_eq!(
            (r.generation, r.spec),
            (Some(Generation(3)), json!({"fw": "2.0"}))
        );
        assert_eq!(s.installed, [3]);
    }

    #[test]
    fn a_spec_the_device_already_runs_is_adopted_without_installing_or_refusing() {
        let mut s = state();
        let same = Desired {
            generation: Generation(7),
            spec: json!({"fw": "1.0"}),
        };
        let b = DeviceBehaviour::Reject {
            message: "flash full".into(),
        };
        let r = respond_to_desired(&mut s, &b, &same).unwrap();
        assert_eq!((r.generation, r.error), (Some(Generation(7)), None));
        assert!(s.installed.is_empty());
        assert_eq!(s.rejections, 0);
    }

    #[test]
    fn silent_and_ignoring_devices_do_not_answer_pushes() {
        for b in [DeviceBehaviour::Silent, DeviceBehaviour::IgnorePushes] {
            let mut s = state();
            assert_eq!(respond_to_desired(&mut s, &b, &desired(2)), None);
            assert_eq!(s, state(), "{b:?} must not change state");
        }
    }

    #[test]
    fn every_report_carries_a_strictly_larger_seq() {
        let mut s = state();
        let seqs: Vec<u64> = (0..5).map(|_| s.report().seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
        assert_eq!(seqs[0], 101);
    }

    #[test]
    fn the_seq_base_is_the_clock_in_microseconds() {
        let base = seq_base_now();
        // 2024-01-01 in microseconds: any sane clock is past it.
        assert!(base > 1_704_067_200_000_000);
        assert!(seq_base_now() >= base);
    }

    #[test]
    fn only_silent_devices_skip_the_report_on_connect() {
        assert!(!DeviceBehaviour::Silent.reports_on_connect_by_default());
        assert!(DeviceBehaviour::IgnorePushes.reports_on_connect_by_default());
        assert!(DeviceBehaviour::Accept.reports_on_connect_by_default());
        assert!(DeviceBehaviour::IgnorePushes.answers_get());
        assert!(!DeviceBehaviour::IgnorePushes.answers_desired());
    }
}
