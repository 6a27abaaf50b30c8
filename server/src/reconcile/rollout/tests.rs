use super::*;

pub(super) fn wave(size: WaveSize) -> WaveSpec {
    WaveSpec::sized(size)
}

pub(super) fn pct(p: f64) -> WaveSize {
    WaveSize::Percent(p)
}

pub(super) fn spec(waves: Vec<WaveSpec>) -> RolloutSpec {
    RolloutSpec::new(waves).unwrap()
}

fn canary_with_gate(max_failures: u64) -> RolloutSpec {
    let mut first = wave(pct(10.0));
    first.gates.max_failures = Some(FailureLimit::Count(max_failures));
    let mut second = wave(pct(50.0));
    second.gates.max_failures = Some(FailureLimit::Count(max_failures));
    spec(vec![first, second, wave(pct(100.0))])
}

fn record_many(
    rollout: &mut Rollout,
    wave: usize,
    outcome: OutcomeKind,
    n: u64,
    now: Instant,
) -> Vec<Transition> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.extend(rollout.record(wave, outcome, now));
    }
    out
}

#[test]
fn wave_ends_are_cumulative_over_the_devices_that_need_a_push_and_rounded_up() {
    let waves = spec(vec![wave(pct(1.0)), wave(pct(10.0)), wave(pct(100.0))]);
    assert_eq!(waves.ends(100), vec![1, 10, 100]);
    // A 1 % canary of 50 devices is one device, never none.
    assert_eq!(waves.ends(50), vec![1, 5, 50]);
    assert_eq!(waves.ends(0), vec![0, 0, 0]);
    let counted = spec(vec![
        wave(WaveSize::Count(10)),
        wave(WaveSize::Count(500)),
        wave(pct(100.0)),
    ]);
    assert_eq!(counted.ends(100_000), vec![10, 500, 100_000]);
    // A small fleet leaves later waves empty, never beyond the fleet.
    assert_eq!(counted.ends(20), vec![10, 20, 20]);
}

#[test]
fn waves_that_do_not_increase_or_end_at_all_devices_are_refused_naming_the_field() {
    let refused = |waves: Vec<WaveSpec>| RolloutSpec::new(waves).unwrap_err().to_string();
    assert_eq!(
        refused(vec![wave(pct(10.0)), wave(pct(50.0))]),
        "`rollout.waves[1].size` is 50%; the last wave must be \"100%\" so that every device is reached"
    );
    assert_eq!(
        refused(vec![wave(pct(50.0)), wave(pct(10.0)), wave(pct(100.0))]),
        "`rollout.waves[1].size` (10%) is not above the wave before it (50%); sizes are cumulative and increase"
    );
    assert!(refused(vec![wave(pct(150.0))]).starts_with("`rollout.waves[0].size` is 150"));
    assert!(refused(vec![wave(pct(0.0)), wave(pct(100.0))]).contains("above 0"));
    assert!(refused(vec![
        wave(pct(10.0)),
        wave(WaveSize::Count(500)),
        wave(pct(100.0))
    ])
    .contains("a count after a percentage"));
    assert!(refused(vec![wave(WaveSize::Count(0)), wave(pct(100.0))]).contains("at least one"));
    assert_eq!(RolloutSpec::new(vec![]).unwrap_err(), RolloutError::NoWaves);
    let mut gated = wave(pct(100.0));
    gated.gates.min_success_ratio = Some(1.5);
    assert!(refused(vec![gated]).starts_with("`rollout.waves[0].gates.min_success_ratio` is 1.5"));
    gated.gates.min_success_ratio = None;
    gated.gates.max_failures = Some(FailureLimit::Ratio(-0.1));
    assert!(refused(vec![gated]).starts_with("`rollout.waves[0].gates.max_failures`"));
}

#[test]
fn a_failure_bound_is_breached_the_moment_failures_pass_it() {
    let gates = Gates {
        max_failures: Some(FailureLimit::Count(2)),
        ..Gates::default()
    };
    let mut counts = WaveCounts {
        size: 40,
        failed: 2,
        ..WaveCounts::default()
    };
    assert_eq!(breach(&gates, &counts), None);
    counts.failed = 3;
    assert_eq!(
        breach(&gates, &counts),
        Some(Breach {
            gate: GateKind::MaxFailures,
            limit: 2.0,
            observed: 3.0
        })
    );
    let share = Gates {
        max_failures: Some(FailureLimit::Ratio(0.05)),
        ..Gates::default()
    };
    assert_eq!(
        breach(&share, &counts).map(|b| b.observed),
        Some(3.0 / 40.0)
    );
}

#[test]
fn a_success_ratio_is_breached_once_it_can_no_longer_be_met() {
    let gates = Gates {
        min_success_ratio: Some(0.9),
        ..Gates::default()
    };
    // 10 devices: 9 must succeed. One failure still leaves it possible.
    let mut counts = WaveCounts {
        size: 10,
        failed: 1,
        ..WaveCounts::default()
    };
    assert_eq!(breach(&gates, &counts), None);
    counts.skipped = 1;
    let breached = breach(&gates, &counts).unwrap();
    assert_eq!(breached.gate, GateKind::MinSuccessRatio);
    assert_eq!(breached.limit, 0.9);
    // An empty wave breaches nothing.
    assert_eq!(breach(&gates, &WaveCounts::default()), None);
}

#[test]
fn a_rollout_starts_its_first_wave_and_moves_on_as_each_wave_completes() {
    let start = Instant::now();
    let (mut rollout, started) = Rollout::start(
        spec(vec![wave(pct(10.0)), wave(pct(100.0))]),
        100,
        Some("alice".into()),
    );
    assert_eq!(started, vec![Transition::WaveStarted { wave: 0 }]);
    assert_eq!(rollout.pushable(), 0..10);
    assert_eq!(
        (rollout.wave_of(0), rollout.wave_of(9), rollout.wave_of(10)),
        (0, 0, 1)
    );
    let out = record_many(&mut rollout, 0, OutcomeKind::Provisioned, 10, start);
    assert_eq!(
        out,
        vec![
            Transition::WaveCompleted {
                wave: 0,
                counts: WaveCounts {
                    size: 10,
                    provisioned: 10,
                    ..WaveCounts::default()
                }
            },
            Transition::WaveStarted { wave: 1 }
        ]
    );
    assert_eq!(rollout.pushable(), 0..100);
    let out = record_many(&mut rollout, 1, OutcomeKind::Provisioned, 90, start);
    assert_eq!(out.last(), Some(&Transition::Completed));
    assert_eq!(rollout.state(), RolloutState::Completed);
}

#[test]
fn a_breached_gate_pauses_at_once_and_nothing_more_is_pushable_until_resumed() {
    let now = Instant::now();
    // 100 devices need a push: waves end at 10, 50, 100.
    let (mut rollout, _) = Rollout::start(canary_with_gate(2), 100, Some("alice".into()));
    record_many(&mut rollout, 0, OutcomeKind::Provisioned, 10, now);
    assert_eq!(rollout.state(), RolloutState::Running { wave: 1 });
    record_many(&mut rollout, 1, OutcomeKind::Failed, 2, now);
    assert_eq!(rollout.state(), RolloutState::Running { wave: 1 });
    let out = rollout.record(1, OutcomeKind::Failed, now);
    let reason = PauseReason::Gate(Breach {
        gate: GateKind::MaxFailures,
        limit: 2.0,
        observed: 3.0,
    });
    assert_eq!(out, vec![Transition::Paused { wave: 1, reason }]);
    assert_eq!(rollout.pushable(), 0..0);
    // Outcomes of devices already pushed still count, and pause nothing again.
    assert_eq!(rollout.record(1, OutcomeKind::Provisioned, now), vec![]);
    assert_eq!(rollout.counts()[1].provisioned, 1);

    // Resumed, the paused wave goes on, its gate waived: further failures
    // do not pause it again.
    assert_eq!(
        rollout.resume(now).unwrap(),
        vec![Transition::Resumed { wave: 1 }]
    );
    assert_eq!(rollout.pushable(), 0..50);
    assert_eq!(rollout.resume(now), Err(NotNow::NotPaused("running")));
    assert_eq!(rollout.record(1, OutcomeKind::Failed, now), vec![]);
    let out = record_many(&mut rollout, 1, OutcomeKind::Provisioned, 35, now);
    assert_eq!(
        out.last(),
        Some(&Transition::WaveStarted { wave: 2 }),
        "{out:?}"
    );
    assert_eq!(rollout.pushable(), 0..100);
}

#[test]
fn an_abort_ends_the_rollout_and_nothing_more_is_pushable() {
    let now = Instant::now();
    let (mut rollout, _) = Rollout::start(canary_with_gate(0), 100, Some("alice".into()));
    rollout.record(0, OutcomeKind::Failed, now);
    assert!(matches!(
        rollout.state(),
        RolloutState::Paused { wave: 0, .. }
    ));
    assert_eq!(rollout.abort(), Ok(vec![Transition::Aborted]));
    assert_eq!(rollout.pushable(), 0..0);
    assert_eq!(rollout.abort(), Err(NotNow::Ended("been aborted")));
    assert_eq!(rollout.resume(now), Err(NotNow::Ended("been aborted")));
}

#[test]
fn a_timed_pause_starts_the_next_wave_when_its_time_has_passed() {
    let start = Instant::now();
    let mut canary = wave(pct(10.0));
    canary.pause = Pause::For(Duration::from_secs(600));
    let (mut rollout, _) = Rollout::start(
        spec(vec![canary, wave(pct(100.0))]),
        10,
        Some("alice".into()),
    );
    let out = rollout.record(0, OutcomeKind::Provisioned, start);
    let until = start + Duration::from_secs(600);
    assert_eq!(
        out.last(),
        Some(&Transition::Paused {
            wave: 0,
            reason: PauseReason::Timed { until }
        })
    );
    assert_eq!(rollout.tick(start + Duration::from_secs(599)), vec![]);
    assert_eq!(
        rollout.tick(until),
        vec![Transition::WaveStarted { wave: 1 }]
    );
}

#[test]
fn a_manual_pause_waits_for_a_resume_and_an_approval_wave_for_an_approval() {
    let now = Instant::now();
    let mut manual = wave(WaveSize::Count(1));
    manual.pause = Pause::Manual;
    let mut approved = wave(WaveSize::Count(2));
    approved.approve = true;
    let (mut rollout, _) = Rollout::start(
        spec(vec![manual, approved, wave(pct(100.0))]),
        10,
        Some("alice".into()),
    );
    rollout.record(0, OutcomeKind::Provisioned, now);
    assert_eq!(
        rollout.state(),
        RolloutState::Paused {
            wave: 0,
            reason: PauseReason::Manual
        }
    );
    assert_eq!(
        rollout.approve("bob", now, Utc::now()),
        Err(NotNow::NoApprovalPending("paused"))
    );
    rollout.resume(now).unwrap();
    rollout.record(1, OutcomeKind::Provisioned, now);
    assert_eq!(
        rollout.state(),
        RolloutState::Paused {
            wave: 1,
            reason: PauseReason::Approval
        }
    );
    assert_eq!(rollout.resume(now), Err(NotNow::AwaitingApproval));
    assert_eq!(
        rollout.approve("alice", now, Utc::now()),
        Err(NotNow::SelfApproval),
        "the author's own approval is refused"
    );
    assert_eq!(
        rollout.approve("bob", now, Utc::now()).unwrap(),
        vec![
            Transition::Approved { wave: 1 },
            Transition::WaveStarted { wave: 2 }
        ]
    );
}

#[test]
fn a_stored_rollout_comes_back_as_it_was_with_a_timed_pause_ending_when_it_would_have() {
    let mut timed = wave(WaveSize::Count(2));
    timed.pause = Pause::For(Duration::from_secs(60));
    timed.gates.max_failures = Some(FailureLimit::Count(0));
    let (mut rollout, _) = Rollout::start(spec(vec![timed, wave(pct(100.0))]), 10, None);
    let now = Instant::now();
    let wall = Utc::now();
    rollout.record(0, OutcomeKind::Provisioned, now);
    rollout.record(0, OutcomeKind::AlreadyConverged, now);
    let stored = rollout.stored(now, wall);
    let json = serde_json::to_value(&stored).unwrap();
    let back: StoredRollout = serde_json::from_value(json).unwrap();
    assert_eq!(back, stored);
    // Restored 20 s later by the wall clock, in a process whose clock
    // started anew: 40 s of the pause are left.
    let later = Instant::now();
    let restored = Rollout::restore(back, later, wall + chrono::Duration::seconds(20)).unwrap();
    assert_eq!(restored.counts(), rollout.counts());
    let until = restored.next_wake().unwrap();
    let left = until.saturating_duration_since(later);
    assert!(
        left <= Duration::from_secs(40) && left > Duration::from_secs(39),
        "{left:?}"
    );
    let view = stored.view();
    assert_eq!(view.state, RolloutStateName::Paused);
    assert_eq!(
        view.paused.as_ref().map(|p| p.reason.as_str()),
        Some("timed")
    );
    assert_eq!(view.waves[0].state, WaveState::Completed);
    assert_eq!(view.waves[0].already_converged, 1);
    assert_eq!(view.waves[1].state, WaveState::Pending);

    let broken = StoredRollout {
        current: 5,
        ..stored
    };
    assert!(Rollout::restore(broken, later, wall).is_err());
}

#[test]
fn a_gate_pause_shows_the_gate_and_its_figures_and_superseded_devices_are_no_verdict() {
    let (mut rollout, _) = Rollout::start(canary_with_gate(0), 100, None);
    let now = Instant::now();
    rollout.record(0, OutcomeKind::Superseded, now);
    assert_eq!(rollout.state(), RolloutState::Running { wave: 0 });
    rollout.record(0, OutcomeKind::Failed, now);
    let view = rollout.stored(now, Utc::now()).view();
    let paused = view.paused.unwrap();
    assert_eq!(
        (paused.wave, paused.reason.as_str(), paused.gate.as_deref()),
        (0, "gate", Some("max_failures"))
    );
    assert_eq!((paused.limit, paused.observed), (Some(0.0), Some(1.0)));
    assert_eq!(view.waves[0].state, WaveState::Paused);

    let gates = Gates {
        min_success_ratio: Some(1.0),
        ..Gates::default()
    };
    let counts = WaveCounts {
        size: 4,
        provisioned: 2,
        already_converged: 1,
        superseded: 1,
        ..WaveCounts::default()
    };
    assert_eq!(breach(&gates, &counts), None, "3 of the 3 judged succeeded");
}

#[test]
fn nothing_to_push_completes_the_rollout_at_its_start() {
    let (rollout, out) = Rollout::start(canary_with_gate(2), 0, Some("alice".into()));
    assert_eq!(rollout.state(), RolloutState::Completed);
    assert_eq!(out.first(), Some(&Transition::WaveStarted { wave: 0 }));
    assert_eq!(out.last(), Some(&Transition::Completed));
}

mod property {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// A device that may have been pushed by now and is not yet
        /// decided (the `n`th of them, wrapping) ends this way: answers
        /// come in any order, also while the rollout is paused.
        Record(OutcomeKind, usize),
        /// Every device of the running wave has been pushed.
        HandOver,
        Tick(u64),
        Resume,
        Approve,
        Abort,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => prop_oneof![
                Just(OutcomeKind::Provisioned),
                Just(OutcomeKind::Failed),
                Just(OutcomeKind::Skipped)
            ]
            .prop_flat_map(|kind| (0usize..200).prop_map(move |n| Op::Record(kind, n))),
            2 => Just(Op::HandOver),
            1 => (0u64..900).prop_map(Op::Tick),
            1 => Just(Op::Resume),
            1 => Just(Op::Approve),
            1 => Just(Op::Abort),
        ]
    }

    /// A drawn wave: percent step, pause kind, min success %, max
    /// failures, approve.
    type Drawn = (u8, u8, Option<u8>, Option<u8>, bool);

    fn wave_spec() -> impl Strategy<Value = Drawn> {
        prop_oneof![
            // Free: nothing after it (it hands over once all are pushed).
            1 => (1u8..60).prop_map(|step| (step, 0, None, None, false)),
            2 => (
                1u8..60,
                0u8..3,
                proptest::option::of(0u8..=100),
                proptest::option::of(0u8..5),
                any::<bool>(),
            ),
        ]
    }

    fn rollout_spec(parts: Vec<Drawn>) -> RolloutSpec {
        let mut at = 0.0;
        let count = parts.len();
        let waves = parts
            .into_iter()
            .enumerate()
            .map(|(i, (step, pause, min_success, max_failures, approve))| {
                at = if i + 1 == count {
                    100.0
                } else {
                    (at + f64::from(step)).min(99.0)
                };
                WaveSpec {
                    size: WaveSize::Percent(at),
                    pause: match pause {
                        0 => Pause::None,
                        1 => Pause::For(Duration::from_secs(300)),
                        _ => Pause::Manual,
                    },
                    gates: Gates {
                        min_success_ratio: min_success.map(|p| f64::from(p) / 100.0),
                        max_failures: max_failures.map(|n| FailureLimit::Count(n.into())),
                    },
                    approve,
                }
            })
            .collect();
        let mut waves = dedup_increasing(waves);
        if let Some(last) = waves.last_mut() {
            // Nothing follows the last wave for these to hold back
            // (`RolloutError::NothingFollows`).
            last.pause = Pause::None;
            last.approve = false;
        }
        RolloutSpec::new(waves).unwrap()
    }

    /// Keeps the percentages strictly increasing (a capped step repeats).
    fn dedup_increasing(waves: Vec<WaveSpec>) -> Vec<WaveSpec> {
        let mut kept: Vec<WaveSpec> = Vec::new();
        for wave in waves {
            let previous = kept.last().map(|w| match w.size {
                WaveSize::Percent(p) => p,
                WaveSize::Count(_) => 0.0,
            });
            match (previous, wave.size) {
                (Some(p), WaveSize::Percent(q)) if q <= p => {
                    if q == 100.0 {
                        if let Some(last) = kept.last_mut() {
                            last.size = WaveSize::Percent(100.0);
                        }
                    }
                }
                (Some(_) | None, _) => kept.push(wave),
            }
        }
        kept
    }

    fn started_wave(transition: &Transition) -> Option<usize> {
        match transition {
            Transition::WaveStarted { wave } => Some(*wave),
            Transition::WaveCompleted { .. }
            | Transition::Paused { .. }
            | Transition::Resumed { .. }
            | Transition::Approved { .. }
            | Transition::Completed
            | Transition::Aborted => None,
        }
    }

    fn completed_wave(transition: &Transition) -> Option<usize> {
        match transition {
            Transition::WaveCompleted { wave, .. } => Some(*wave),
            Transition::WaveStarted { .. }
            | Transition::Paused { .. }
            | Transition::Resumed { .. }
            | Transition::Approved { .. }
            | Transition::Completed
            | Transition::Aborted => None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn whatever_the_order_of_outcomes_pauses_resumes_and_aborts_a_rollout_stays_consistent(
            parts in proptest::collection::vec(wave_spec(), 1..6),
            needing in 0u64..120,
            ops in proptest::collection::vec(op(), 0..200),
        ) {
            let spec = rollout_spec(parts);
            let waves = spec.waves().len();
            let (mut rollout, started) = Rollout::start(spec, needing, Some("alice".into()));
            let mut now = Instant::now();
            let mut decided = 0u64;
            let mut recorded = std::collections::BTreeSet::new();
            let mut started_waves: Vec<usize> = started.iter().filter_map(started_wave).collect();
            let mut completed_waves: Vec<usize> = started.iter().filter_map(completed_wave).collect();
            let mut reach = rollout.pushable().end;
            // Devices that may have been pushed at some point.
            let mut ever_pushable = reach;
            for op in ops {
                let out = match op {
                    Op::Record(outcome, n) => {
                        let open: Vec<u64> =
                            (0..ever_pushable).filter(|i| !recorded.contains(i)).collect();
                        if open.is_empty() {
                            continue;
                        }
                        let index = open[n % open.len()];
                        recorded.insert(index);
                        let wave = rollout.wave_of(index);
                        decided += 1;
                        rollout.record(wave, outcome, now)
                    }
                    Op::HandOver => match rollout.state() {
                        RolloutState::Running { wave } => rollout.hand_over(wave, now),
                        RolloutState::Paused { .. }
                        | RolloutState::Completed
                        | RolloutState::Aborted => continue,
                    },
                    Op::Tick(secs) => {
                        now += Duration::from_secs(secs);
                        rollout.tick(now)
                    }
                    Op::Resume => rollout.resume(now).unwrap_or_default(),
                    Op::Approve => rollout.approve("bob", now, Utc::now()).unwrap_or_default(),
                    Op::Abort => rollout.abort().unwrap_or_default(),
                };
                started_waves.extend(out.iter().filter_map(started_wave));
                completed_waves.extend(out.iter().filter_map(completed_wave));
                ever_pushable = ever_pushable.max(rollout.pushable().end);
                match rollout.state() {
                    RolloutState::Running { wave } => {
                        prop_assert!(wave < waves);
                        // What may be pushed only ever grows while running.
                        prop_assert!(rollout.pushable().end >= reach);
                        reach = rollout.pushable().end;
                        // A running wave has no certain breach, unless an
                        // operator resumed past it.
                        if !rollout.waived[wave] {
                            prop_assert_eq!(
                                breach(&rollout.spec.waves[wave].gates, &rollout.counts()[wave]),
                                None
                            );
                        }
                    }
                    RolloutState::Paused { wave, .. } => {
                        prop_assert!(wave < waves);
                        prop_assert_eq!(rollout.pushable(), 0..0);
                    }
                    RolloutState::Completed => {
                        prop_assert!(rollout.counts().iter().all(WaveCounts::is_done));
                        prop_assert_eq!(rollout.pushable(), 0..0);
                    }
                    RolloutState::Aborted => prop_assert_eq!(rollout.pushable(), 0..0),
                }
            }
            // Each wave started once, in order.
            let mut sorted = started_waves.clone();
            sorted.dedup();
            prop_assert_eq!(&sorted, &started_waves);
            prop_assert!(started_waves.windows(2).all(|w| w[0] < w[1]));
            // Each wave completed at most once, only once started and done.
            let mut once = completed_waves.clone();
            once.sort_unstable();
            once.dedup();
            prop_assert_eq!(once.len(), completed_waves.len());
            for wave in &completed_waves {
                prop_assert!(started_waves.contains(wave));
                prop_assert!(rollout.counts()[*wave].is_done());
            }
            // A wave is open only while it waits for answers: every started
            // wave that is done was said to be completed, unless the
            // rollout was aborted first or is paused on that wave's gate
            // (it completes on the resume).
            let paused_on_gate = match rollout.state() {
                RolloutState::Paused { wave, reason: PauseReason::Gate(_) } => Some(wave),
                RolloutState::Paused { .. }
                | RolloutState::Running { .. }
                | RolloutState::Completed
                | RolloutState::Aborted => None,
            };
            if rollout.state() != RolloutState::Aborted {
                for wave in &started_waves {
                    if rollout.counts()[*wave].is_done() && paused_on_gate != Some(*wave) {
                        prop_assert!(completed_waves.contains(wave), "wave {} done, never completed", wave);
                    }
                }
            }
            // Every recorded outcome is counted once, in its wave.
            let counted: u64 = rollout.counts().iter().map(WaveCounts::decided).sum();
            prop_assert_eq!(counted, decided);
            prop_assert!(rollout.counts().iter().all(|c| c.decided() <= c.size));
            prop_assert_eq!(rollout.counts().iter().map(|c| c.size).sum::<u64>(), needing);
        }
    }
}

#[test]
fn only_a_wave_without_gate_pause_or_approval_is_followed_at_once() {
    let mut paused = wave(pct(20.0));
    paused.pause = Pause::Manual;
    let mut timed = wave(pct(30.0));
    timed.pause = Pause::For(Duration::from_secs(1));
    let mut zero = wave(pct(40.0));
    zero.pause = Pause::For(Duration::ZERO);
    let mut approve = wave(pct(50.0));
    approve.approve = true;
    let mut gated = wave(pct(60.0));
    gated.gates.min_success_ratio = Some(0.5);
    let waves = vec![
        wave(pct(10.0)),
        paused,
        timed,
        zero,
        approve,
        gated,
        wave(pct(100.0)),
    ];
    let (rollout, _) = Rollout::start(spec(waves), 100, None);
    let at_once: Vec<bool> = (0..8).map(|w| rollout.follows_at_once(w)).collect();
    // The last wave has no wave after it; an index past the end is none.
    assert_eq!(
        at_once,
        [true, false, false, true, false, false, false, false]
    );
}

#[test]
fn a_waived_gate_no_longer_stands_between_its_wave_and_the_next() {
    let (mut rollout, _) = Rollout::start(canary_with_gate(0), 100, None);
    assert!(!rollout.follows_at_once(0));
    let now = Instant::now();
    rollout.record(0, OutcomeKind::Failed, now);
    rollout.resume(now).unwrap();
    assert!(rollout.follows_at_once(0));
}

#[test]
fn pushes_marked_before_their_own_write_are_stored_and_come_back_with_the_rollout() {
    let (mut rollout, _) = Rollout::start(spec(vec![wave(pct(50.0)), wave(pct(100.0))]), 10, None);
    let mark = EarlyPushes {
        wave: 1,
        last: "d-00007".into(),
    };
    assert!(mark.covers(1, "d-00005") && mark.covers(1, "d-00007"));
    assert!(mark.covers(0, "d-00009"), "every device of an earlier wave");
    assert!(!mark.covers(1, "d-00008") && !mark.covers(2, "d-00000"));
    rollout.mark_early(Some(mark.clone()));
    let now = Instant::now();
    let wall = Utc::now();
    let json = rollout.stored(now, wall).to_json();
    assert_eq!(
        json["early"],
        serde_json::json!({"wave": 1, "last": "d-00007"})
    );
    let back: StoredRollout = serde_json::from_value(json).unwrap();
    let restored = Rollout::restore(back, now, wall).unwrap();
    assert_eq!(restored.early(), Some(&mark));
    // A row written without the mark reads as none.
    rollout.mark_early(None);
    let mut json = rollout.stored(now, wall).to_json();
    assert!(json.get("early").is_none());
    json.as_object_mut().unwrap().remove("early");
    let back: StoredRollout = serde_json::from_value(json).unwrap();
    assert_eq!(back.early, None);
}
