//! Pauses and approvals hold back only the waves after their own: on the
//! last wave they are refused, and after the last wave that holds devices
//! the rollout goes on to its end.

use super::tests::{pct, spec, wave};
use super::*;

#[test]
fn an_approval_or_a_pause_on_the_last_wave_is_refused_naming_the_field() {
    let refused = |waves: Vec<WaveSpec>| RolloutSpec::new(waves).unwrap_err().to_string();
    let mut approve = wave(pct(100.0));
    approve.approve = true;
    assert_eq!(
        refused(vec![wave(pct(10.0)), approve]),
        "`rollout.waves[1].approve` is set on the last wave, but an approval holds back the waves \
         after its own and none follows; drop it, or add a wave after it"
    );
    let mut manual = wave(pct(100.0));
    manual.pause = Pause::Manual;
    assert!(refused(vec![manual]).starts_with("`rollout.waves[0].pause` is set on the last wave"));
    let mut timed = wave(pct(100.0));
    timed.pause = Pause::For(Duration::from_secs(60));
    assert!(refused(vec![timed]).contains("a pause holds back"));
    // A zero pause holds nothing: accepted.
    let mut zero = wave(pct(100.0));
    zero.pause = Pause::For(Duration::ZERO);
    assert!(RolloutSpec::new(vec![zero]).is_ok());
}

#[test]
fn a_rollout_with_nothing_to_push_completes_at_once_though_its_waves_ask_for_approval_and_pauses() {
    let mut approve = wave(pct(10.0));
    approve.approve = true;
    let mut manual = wave(pct(50.0));
    manual.pause = Pause::Manual;
    let (rollout, transitions) = Rollout::start(
        spec(vec![approve, manual, wave(pct(100.0))]),
        0,
        Some("alice".into()),
    );
    assert_eq!(rollout.state(), RolloutState::Completed);
    assert_eq!(transitions.last(), Some(&Transition::Completed));
    assert!(
        !transitions
            .iter()
            .any(|t| matches!(t, Transition::Paused { .. })),
        "{transitions:?}"
    );
}

#[test]
fn an_approval_after_the_last_wave_with_devices_in_it_is_not_waited_for() {
    let now = Instant::now();
    let mut approve = wave(WaveSize::Count(2));
    approve.approve = true;
    // Two devices need a push: the first wave holds both, the rest are empty.
    let (mut rollout, _) = Rollout::start(
        spec(vec![approve, wave(WaveSize::Count(10)), wave(pct(100.0))]),
        2,
        Some("alice".into()),
    );
    assert!(rollout.record(0, OutcomeKind::Provisioned, now).is_empty());
    let out = rollout.record(0, OutcomeKind::Provisioned, now);
    assert_eq!(rollout.state(), RolloutState::Completed, "{out:?}");
    assert_eq!(out.last(), Some(&Transition::Completed));
}
