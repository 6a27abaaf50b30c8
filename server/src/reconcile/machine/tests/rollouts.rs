//! Staged rollouts in the machine, time moved by hand: only the running
//! wave's devices are pushed, a breached gate pauses at once, resumes,
//! timed and manual pauses, approvals, aborts, superseding, and a restart
//! in the middle of a wave.

use super::*;
use crate::reconcile::rollout::{
    FailureLimit, Gates, Pause, RolloutSpec, StoredState, WaveSize, WaveSpec,
};
use idem_protocol::api::WaveState;

fn wave(size: WaveSize) -> WaveSpec {
    WaveSpec::sized(size)
}

fn pct(p: f64) -> WaveSize {
    WaveSize::Percent(p)
}

/// Waves `10%, 50%, 100%`, each gated at `max_failures`.
fn gated(max_failures: u64) -> RolloutSpec {
    let gate = |size| WaveSpec {
        gates: Gates {
            max_failures: Some(FailureLimit::Count(max_failures)),
            ..Gates::default()
        },
        ..wave(size)
    };
    RolloutSpec::new(vec![gate(pct(10.0)), gate(pct(50.0)), gate(pct(100.0))]).unwrap()
}

/// One attempt per push (a refusal fails the device at once).
fn no_retries() -> EngineSettings {
    let mut settings = settings();
    settings.retry.max_attempts = 1;
    settings
}

/// 100 devices want version 2; the first 20 (`d-00000`…`d-00019`) run
/// version 1 and need a push, the other 80 are already converged.
fn fleet(world: &mut World) -> Vec<DeviceId> {
    world.fleet_of(100, 20)
}

/// Every device pushed and not yet answered confirms the push.
fn confirm_all(world: &mut World, answered: &mut usize) {
    let pushed = world.pushed();
    for device in &pushed[*answered..] {
        world.reports(device, 2, Some(2));
    }
    *answered = pushed.len();
    world.settle();
}

/// An operator's action on `run`'s rollout, carried out and written.
fn act(
    world: &mut World,
    run: Uuid,
    action: RolloutAction,
) -> Result<crate::reconcile::rollout::StoredRollout, RolloutActionError> {
    let (effects, stored) = world.machine.act_on_rollout(run, action, world.now())?;
    world.carry(effects);
    world.settle();
    Ok(stored)
}

fn event_types(world: &World) -> Vec<&'static str> {
    world
        .rollout_events
        .iter()
        .map(|(t, _)| t.as_str().trim_start_matches("io.idem.rollout."))
        .collect()
}

fn names(ids: &[DeviceId]) -> Vec<String> {
    ids.iter().map(ToString::to_string).collect()
}

#[test]
fn only_the_running_wave_is_pushed_and_converged_devices_are_in_no_wave() {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, gated(2), "alice");
    world.settle();
    // 20 need a push: waves end at 2, 10 and 20 of them.
    assert_eq!(world.counts(run).already_converged, 80);
    assert_eq!(names(&world.pushed()), ["d-00000", "d-00001"]);
    let mut answered = 0;
    confirm_all(&mut world, &mut answered);
    assert_eq!(world.pushed().len(), 10, "the second wave takes up to 10");
    confirm_all(&mut world, &mut answered);
    assert_eq!(world.pushed().len(), 20);
    confirm_all(&mut world, &mut answered);
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run), counts(80, 20, 0));
    assert_eq!(
        event_types(&world),
        [
            "wave_started",
            "wave_completed",
            "wave_started",
            "wave_completed",
            "wave_started",
            "wave_completed"
        ]
    );
    let stored = &world.rollouts[&run];
    assert_eq!(stored.state, StoredState::Completed);
    let sizes: Vec<u64> = stored.counts.iter().map(|c| c.size).collect();
    assert_eq!(sizes, [2, 8, 10]);
    assert_eq!(world.rollout_events[1].1["provisioned"], 2);
}

#[test]
fn a_breached_gate_pauses_at_once_and_nothing_more_is_pushed_until_a_resume() {
    let mut world = World::new(no_retries());
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, gated(2), "alice");
    world.settle();
    let mut answered = 0;
    confirm_all(&mut world, &mut answered);
    // Wave 1: d-00002 … d-00009. Three refuse, the rest do not answer yet.
    let wave_one = world.pushed()[2..].to_vec();
    assert_eq!(wave_one.len(), 8);
    for device in &wave_one[..3] {
        world.rejects(device, 2, 1);
    }
    world.settle();
    let (kind, data) = world.rollout_events.last().unwrap();
    assert_eq!(*kind, EventType::RolloutPaused);
    assert_eq!(data["gate"], "max_failures");
    assert_eq!(data["wave"], 1);
    assert_eq!(data["limit"], 2.0);
    assert_eq!(data["observed"], 3.0);
    // The wave's other pushes are answered; nothing more goes out.
    for device in &wave_one[3..] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    world.wait(Duration::from_secs(30));
    assert_eq!(world.pushed().len(), 10, "paused: no further push");
    assert!(!world.is_completed(run));

    let stored = act(&mut world, run, RolloutAction::Resume).unwrap();
    assert_eq!(
        stored.current, 2,
        "the paused wave was done: the next one runs"
    );
    assert_eq!(world.pushed().len(), 20);
    answered = 10;
    confirm_all(&mut world, &mut answered);
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run), counts(80, 17, 3));
    assert!(event_types(&world).contains(&"resumed"));
}

#[test]
fn an_abort_skips_the_devices_not_yet_pushed_and_keeps_the_outcomes_of_those_pushed() {
    let mut world = World::new(no_retries());
    let targets = fleet(&mut world);
    // The broker still holds generation 1 retained for the devices that
    // need the change, as after any desired change.
    for device in &targets[..20] {
        let change = DeviceChange {
            retained: Some(Generation(1)),
            ..DeviceChange::default()
        };
        world
            .fleet
            .apply_committed([FleetChange::Engine(device.clone(), change)]);
    }
    let run = world.create_rollout(targets, gated(0), "alice");
    world.settle();
    // Wave 0 (d-00000, d-00001): one refuses, the gate pauses at once;
    // the other is still in flight.
    world.rejects(&id("d-00000"), 2, 1);
    world.settle();
    let resumed = act(&mut world, run, RolloutAction::Resume).unwrap();
    assert_eq!(resumed.state, StoredState::Running, "a gate pause resumes");
    // Its gate waived, the wave goes on; abort while d-00001's push is out.
    let stored = act(&mut world, run, RolloutAction::Abort).unwrap();
    assert_eq!(stored.state, StoredState::Aborted);
    assert!(!world.is_completed(run), "d-00001's push is still answered");
    world.reports(&id("d-00001"), 2, Some(2));
    world.settle();
    assert!(world.is_completed(run));
    let outcomes = &world.outcomes[&run];
    let aborted = outcomes
        .iter()
        .filter(|(_, kind, reason)| {
            *kind == OutcomeKind::Skipped && reason.as_deref() == Some("aborted")
        })
        .count();
    assert_eq!(aborted, 18);
    assert_eq!(world.counts(run).provisioned, 1);
    assert_eq!(world.counts(run).failed, 1);
    assert_eq!(world.pushed().len(), 2, "nothing pushed after the abort");
    assert!(
        world
            .published
            .iter()
            .all(|(_, _, reason)| *reason == PublishReason::Attempt),
        "no retained refresh brought the aborted devices the change"
    );
    assert_eq!(
        act(&mut world, run, RolloutAction::Resume).unwrap_err(),
        RolloutActionError::NotInProgress
    );
}

#[test]
fn a_timed_pause_starts_the_next_wave_when_it_is_over_and_a_manual_one_waits_for_a_resume() {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let timed = WaveSpec {
        pause: Pause::For(Duration::from_secs(60)),
        ..wave(WaveSize::Count(2))
    };
    let manual = WaveSpec {
        pause: Pause::Manual,
        ..wave(WaveSize::Count(5))
    };
    let spec = RolloutSpec::new(vec![timed, manual, wave(pct(100.0))]).unwrap();
    let run = world.create_rollout(targets, spec, "alice");
    world.settle();
    let mut answered = 0;
    confirm_all(&mut world, &mut answered);
    world.wait(Duration::from_secs(59));
    assert_eq!(world.pushed().len(), 2, "the pause is not over");
    world.wait(Duration::from_secs(2));
    assert_eq!(world.pushed().len(), 5);
    confirm_all(&mut world, &mut answered);
    world.wait(Duration::from_secs(600));
    assert_eq!(world.pushed().len(), 5, "a manual pause waits");
    let _ = act(&mut world, run, RolloutAction::Resume).unwrap();
    assert_eq!(world.pushed().len(), 20);
}

#[test]
fn a_wave_marked_approve_waits_for_someone_other_than_the_author() {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let approve = WaveSpec {
        approve: true,
        ..wave(WaveSize::Count(2))
    };
    let spec = RolloutSpec::new(vec![approve, wave(pct(100.0))]).unwrap();
    let run = world.create_rollout(targets, spec, "alice");
    world.settle();
    let mut answered = 0;
    confirm_all(&mut world, &mut answered);
    assert_eq!(world.pushed().len(), 2);
    let by = |name: &str| RolloutAction::Approve { by: name.into() };
    assert_eq!(
        act(&mut world, run, by("alice")).unwrap_err(),
        RolloutActionError::NotNow(crate::reconcile::rollout::NotNow::SelfApproval)
    );
    assert_eq!(
        act(&mut world, run, RolloutAction::Resume).unwrap_err(),
        RolloutActionError::NotNow(crate::reconcile::rollout::NotNow::AwaitingApproval)
    );
    let stored = act(&mut world, run, by("bob")).unwrap();
    assert_eq!(stored.approvals.len(), 1);
    assert_eq!(stored.approvals[0].by, "bob");
    assert_eq!(world.pushed().len(), 20);
    let (kind, data) = world
        .rollout_events
        .iter()
        .find(|(kind, _)| *kind == EventType::RolloutApproved)
        .unwrap();
    assert_eq!(kind.as_str(), "io.idem.rollout.approved");
    assert_eq!(data["by"], "bob");
}

#[test]
fn a_newer_change_supersedes_the_devices_still_waiting_for_their_wave() {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, gated(2), "alice");
    world.settle();
    // d-00015 waits for the last wave; a newer change reaches it.
    world.wants(&id("d-00015"), 3, 3);
    world.command(EngineCommand::DesiredChanged(vec![id("d-00015")]));
    world.settle();
    let superseded: Vec<_> = world
        .kinds(run)
        .into_iter()
        .filter(|(_, kind)| *kind == OutcomeKind::Superseded)
        .collect();
    assert_eq!(superseded, [(id("d-00015"), OutcomeKind::Superseded)]);
    let mut answered = 0;
    for _ in 0..3 {
        confirm_all(&mut world, &mut answered);
    }
    assert!(world.is_completed(run));
    assert_eq!(
        world.counts(run),
        OutcomeCounts {
            already_converged: 80,
            provisioned: 19,
            superseded: 1,
            ..OutcomeCounts::default()
        }
    );
    assert_eq!(world.rollouts[&run].counts[2].superseded, 1);
}

#[test]
fn a_restart_in_the_middle_of_a_wave_goes_on_where_it_was_and_pushes_no_device_twice() {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, gated(2), "alice");
    world.settle();
    let mut answered = 0;
    confirm_all(&mut world, &mut answered);
    // Wave 1 is out; half of it answered before the process dies.
    let wave_one = world.pushed()[2..].to_vec();
    for device in &wave_one[..4] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    world.restart();
    world.settle();
    // The other half answers the pushes of the earlier process.
    for device in &wave_one[4..] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    answered = 10;
    confirm_all(&mut world, &mut answered);
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run), counts(80, 20, 0));
    let mut pushed = world.pushed();
    let total = pushed.len();
    pushed.sort_unstable();
    pushed.dedup();
    assert_eq!(total, pushed.len(), "no device pushed twice");
    assert_eq!(total, 20);
}

#[test]
fn a_large_wave_is_written_ahead_and_pushed_in_chunks_each_written_before_it_is_sent() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(600, 600);
    let spec = RolloutSpec::new(vec![wave(pct(100.0))]).unwrap();
    world.create_rollout(fleet.clone(), spec, "alice");
    // The wave starts with one chunk, written before it went out.
    let first = world.pushed();
    assert_eq!(first.len(), crate::reconcile::machine::WRITE_AHEAD_CHUNK);
    for device in &first {
        let entry = world.fleet.get(device).unwrap();
        assert_eq!(entry.status, DeviceStatus::Provisioning, "{device}");
        assert_eq!(entry.retained_generation, Some(Generation(2)), "{device}");
    }
    // The next chunks follow at once (the machine wakes now), without
    // waiting for answers.
    assert!(world.machine.next_wake() <= world.clock);
    world.wait(Duration::from_millis(200));
    let all = world.pushed();
    assert_eq!(all.len(), 600);
    let mut distinct = all.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct, fleet, "each device pushed once");
}

#[test]
fn past_its_first_chunk_a_large_rollout_pushes_under_a_written_mark_without_a_write_of_its_own() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(3_000, 3_000);
    let spec = RolloutSpec::new(vec![wave(pct(50.0)), wave(pct(100.0))]).unwrap();
    let run = world.create_rollout(fleet.clone(), spec, "alice");
    let mut answered = 0;
    while !world.is_completed(run) && answered < 3_000 {
        confirm_all(&mut world, &mut answered);
    }
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run).provisioned, 3_000);
    let sends = &world.rollout_sends;
    let mut distinct: Vec<&DeviceId> = sends.iter().map(|send| &send.device).collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        (sends.len(), distinct.len()),
        (3_000, 3_000),
        "each pushed once"
    );
    let unrecorded: Vec<&RolloutSend> = sends.iter().filter(|s| !s.written && !s.marked).collect();
    assert!(
        unrecorded.is_empty(),
        "sent with nothing written: {unrecorded:?}"
    );
    let chunk = crate::reconcile::machine::WRITE_AHEAD_CHUNK;
    let waited: Vec<usize> = (0..sends.len()).filter(|i| sends[*i].written).collect();
    assert_eq!(
        waited,
        (0..chunk).collect::<Vec<_>>(),
        "only the first chunk waits for a write of its own"
    );
    let mark = world.rollouts[&run].early.clone().unwrap();
    assert_eq!((mark.wave, mark.last.as_str()), (1, "d-02999"));
}

/// Waves `50%, 100%` with nothing between them, over `fleet` (20 need a
/// push: `d-00000`…`d-00009` in the first wave, `d-00010`…`d-00019` in
/// the second).
fn two_free_waves() -> RolloutSpec {
    RolloutSpec::new(vec![wave(pct(50.0)), wave(pct(100.0))]).unwrap()
}

/// `device` confirms generation 2, stored; the machine's answer to it,
/// not yet carried out.
fn confirmation_effects(world: &mut World, device: &DeviceId) -> Vec<Effect> {
    world.seq += 1;
    world.fleet.apply_committed([FleetChange::Reported {
        id: device.clone(),
        reported: ReportedState {
            seq: world.seq,
            digest: SpecDigest::of(&spec(2)),
            generation: Some(Generation(2)),
            rejection: None,
            drift: None,
        },
        health: None,
    }]);
    let now = world.now();
    world
        .machine
        .on_command(EngineCommand::ReportsApplied(vec![device.clone()]), now)
}

/// The devices pushed by `effects` before its first record.
fn sent_before_any_write(effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .take_while(|effect| !matches!(effect, Effect::Record(_)))
        .filter_map(|effect| match effect {
            Effect::Publish {
                device,
                reason: PublishReason::Attempt,
                ..
            } => Some(device.to_string()),
            Effect::Publish { .. }
            | Effect::AskForReport { .. }
            | Effect::StartRun { .. }
            | Effect::Record(_) => None,
        })
        .collect()
}

fn second_wave() -> Vec<String> {
    (10..20).map(|i| format!("d-{i:05}")).collect()
}

/// Waves `50%, 100%`: the first gated at no failure, the second free.
fn gated_then_free() -> RolloutSpec {
    let gated = WaveSpec {
        gates: Gates {
            max_failures: Some(FailureLimit::Count(0)),
            ..Gates::default()
        },
        ..wave(pct(50.0))
    };
    RolloutSpec::new(vec![gated, wave(pct(100.0))]).unwrap()
}

/// A rollout of [`gated_then_free`] over `fleet` (one attempt per push)
/// whose first wave paused on `d-00000`'s refusal; its first wave's
/// pushes. A resume waives the gate: then nothing but the wave's
/// answers stands between it and the second wave.
fn paused_on_its_first_wave(world: &mut World) -> (Uuid, Vec<DeviceId>) {
    let targets = fleet(world);
    let run = world.create_rollout(targets, gated_then_free(), "alice");
    world.settle();
    assert_eq!(
        world.rollouts[&run].early, None,
        "a gated wave marks nothing"
    );
    world.rejects(&id("d-00000"), 2, 1);
    world.settle();
    let first = world.pushed();
    assert_eq!(first.len(), 10);
    (run, first)
}

#[test]
fn a_wave_resumed_past_its_gate_sends_the_next_waves_first_pushes_the_moment_it_ends_marked_in_a_write_before(
) {
    let mut world = World::new(no_retries());
    let (run, first) = paused_on_its_first_wave(&mut world);
    act(&mut world, run, RolloutAction::Resume).unwrap();
    // Written with the rollout while the first wave's rest is answered:
    // the second wave's pushes, marked as possibly sent ahead of their
    // wave.
    let early = world.rollouts[&run].early.clone().unwrap();
    assert_eq!((early.wave, early.last.as_str()), (1, "d-00019"));
    assert_ne!(world.status(&id("d-00010")), DeviceStatus::Provisioning);
    for device in &first[1..9] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    assert_eq!(
        world.pushed().len(),
        10,
        "the waived wave is watched to its end"
    );
    // The first wave's last answer starts the second wave, whose pushes
    // leave before anything is written.
    let effects = confirmation_effects(&mut world, &first[9]);
    assert_eq!(sent_before_any_write(&effects), second_wave());
    world.carry(effects);
    world.settle();
    // The record after them marks them pushed; the mark has nothing more
    // to cover.
    assert_eq!(world.status(&id("d-00010")), DeviceStatus::Provisioning);
    assert_eq!(world.rollouts[&run].early, Some(early));
    let mut answered = 10;
    confirm_all(&mut world, &mut answered);
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run), counts(80, 19, 1));
    assert_eq!(world.pushed().len(), 20, "each device pushed once");
}

#[test]
fn a_gated_wave_is_never_pushed_ahead_and_its_pushes_wait_for_their_own_write() {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, gated(2), "alice");
    world.settle();
    assert_eq!(world.rollouts[&run].early, None);
    let first = world.pushed();
    world.reports(&first[0], 2, Some(2));
    world.settle();
    let effects = confirmation_effects(&mut world, &first[1]);
    assert_eq!(sent_before_any_write(&effects), Vec::<String>::new());
    world.carry(effects);
    assert_eq!(
        world.pushed().len(),
        10,
        "the second wave went, after its write"
    );
}

#[test]
fn a_mark_whose_write_has_not_committed_lets_no_push_skip_its_own_write() {
    let mut world = World::new(no_retries());
    let (run, first) = paused_on_its_first_wave(&mut world);
    // Every write from the resume on is still in flight.
    world.hold_writes();
    act(&mut world, run, RolloutAction::Resume).unwrap();
    for device in &first[1..9] {
        world.reports(device, 2, Some(2));
    }
    let effects = confirmation_effects(&mut world, &first[9]);
    assert_eq!(sent_before_any_write(&effects), Vec::<String>::new());
    world.carry(effects);
    assert_eq!(world.pushed().len(), 20, "after their own write");
    world.commit_held();
    world.settle();
    let mut answered = 10;
    confirm_all(&mut world, &mut answered);
    assert_eq!(world.counts(run), counts(80, 19, 1));
}

#[test]
fn after_a_restart_a_push_marked_ahead_is_awaited_not_repeated_and_one_never_sent_goes_once_without_a_failure(
) {
    let mut world = World::new(no_retries());
    let (run, first) = paused_on_its_first_wave(&mut world);
    act(&mut world, run, RolloutAction::Resume).unwrap();
    for device in &first[1..9] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    // The first wave's last answer lets the second wave's marked pushes
    // go; the process dies before the write that records them.
    world.hold_writes();
    world.reports(&first[9], 2, Some(2));
    assert_eq!(world.pushed().len(), 20);
    world.restart();
    world.settle();
    // Five of them answer the earlier process's push; five never got it.
    for i in 10..15 {
        world.reports(&id(&format!("d-{i:05}")), 2, Some(2));
    }
    world.settle();
    assert_eq!(
        world.pushed().len(),
        20,
        "no marked push repeated while awaited"
    );
    world.wait(PUSH_TIMEOUT + SCAN_INTERVAL);
    let pushed = world.pushed();
    let again: Vec<String> = pushed[20..].iter().map(ToString::to_string).collect();
    assert_eq!(
        again,
        (15..20).map(|i| format!("d-{i:05}")).collect::<Vec<_>>()
    );
    for device in &pushed[20..] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    assert!(world.is_completed(run));
    assert_eq!(
        world.counts(run),
        counts(80, 19, 1),
        "no failure for an unsent push"
    );
}

#[test]
fn a_wave_nothing_can_stop_hands_over_once_its_last_push_is_out_and_completes_when_its_last_answer_is_in(
) {
    let mut world = World::new(settings());
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, two_free_waves(), "alice");
    world.settle();
    assert_eq!(
        world.pushed().len(),
        20,
        "the second wave went while the first one's pushes were still out"
    );
    assert_eq!(event_types(&world), ["wave_started", "wave_started"]);
    let view = world.rollouts[&run].view();
    assert_eq!(view.wave, 1);
    assert_eq!(
        (view.waves[0].state, view.waves[1].state),
        (WaveState::Running, WaveState::Running),
        "the first wave is open until its answers are in"
    );
    // The second wave is answered first: it completes, the rollout waits.
    let pushed = world.pushed();
    for device in &pushed[10..] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    assert_eq!(
        event_types(&world),
        ["wave_started", "wave_started", "wave_completed"]
    );
    assert!(!world.is_completed(run));
    assert_eq!(world.rollouts[&run].state, StoredState::Running);
    for device in &pushed[..10] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    assert_eq!(
        event_types(&world),
        [
            "wave_started",
            "wave_started",
            "wave_completed",
            "wave_completed"
        ]
    );
    assert!(world.is_completed(run));
    assert_eq!(world.rollouts[&run].state, StoredState::Completed);
    let view = world.rollouts[&run].view();
    assert_eq!(view.waves[0].provisioned, 10);
    assert_eq!(view.waves[1].provisioned, 10);
    assert_eq!(world.counts(run), counts(80, 20, 0));
    assert_eq!(world.pushed().len(), 20, "each device pushed once");
}

#[test]
fn a_wave_hands_over_only_once_its_last_device_is_pushed() {
    let mut settings = settings();
    settings.max_in_flight = 4;
    let mut world = World::new(settings);
    let targets = fleet(&mut world);
    let run = world.create_rollout(targets, two_free_waves(), "alice");
    world.settle();
    assert_eq!(world.pushed().len(), 4, "the cap holds the rest queued");
    let mut answered = 0;
    confirm_all(&mut world, &mut answered);
    assert_eq!(world.pushed().len(), 8);
    assert_eq!(
        world.rollouts[&run].current, 0,
        "two of the wave wait to be sent"
    );
    confirm_all(&mut world, &mut answered);
    // The wave's last two went, then the next wave took the free slots.
    let pushed = names(&world.pushed());
    assert_eq!(pushed.len(), 12);
    let first_wave: Vec<String> = (0..10).map(|i| format!("d-{i:05}")).collect();
    let mut sent_first = pushed[..10].to_vec();
    sent_first.sort();
    assert_eq!(
        sent_first, first_wave,
        "no device of the next wave before the last of this one"
    );
    assert_eq!(world.rollouts[&run].current, 1);
    while world.pushed().len() > answered {
        confirm_all(&mut world, &mut answered);
    }
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run), counts(80, 20, 0));
    assert_eq!(world.pushed().len(), 20);
}
