//! Plans against the machine: for any fleet a random history leaves
//! behind, a plan's verdict for each device is what applying it does
//! first, device for device — `converged` ends `already_converged` at the
//! run's creation, `push` is pushed, `skipped` ends skipped for the same
//! reason, `no_report` is asked for a report. Some devices own a field
//! the new spec may name: they compare the spec without it, in the plan as
//! in the run.

use super::property::{step, Step, DEVICES};
use super::*;
use crate::reconcile::outcome::Outcome;
use crate::reconcile::owned::{parse_path, NewSpecDigests, OwnedFields};
use crate::reconcile::plan::{plan_devices, PlanSkip, Verdict};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn a_plans_verdict_for_each_device_is_what_applying_it_does_first(
        initial in proptest::collection::vec((1u64..3, proptest::option::of(1u64..3)), DEVICES),
        steps in proptest::collection::vec(step(), 0..30),
        version in 1u64..4,
        force in any::<bool>(),
        owners in proptest::collection::vec(any::<bool>(), DEVICES),
        uptime in proptest::option::of(0u64..3),
    ) {
        let mut world = World::new(settings());
        let fleet: Vec<DeviceId> = initial
            .iter()
            .enumerate()
            .map(|(i, (desired, reported))| world.device(&format!("p-{i}"), Some(*desired), *reported))
            .collect();
        let owned = Arc::new(OwnedFields::new(vec![parse_path("uptime").unwrap()]));
        for (device, _) in fleet.iter().zip(&owners).filter(|(_, owns)| **owns) {
            world.owns(device, &owned);
        }
        let steps: Vec<&Step> = steps.iter().filter(|s| !matches!(s, Step::HoldWrites)).collect();
        for step in steps {
            world.play(&fleet, step);
        }
        for _ in 0..40 {
            world.wait(Duration::from_secs(2));
        }
        // Nothing in flight: the plan is applied with nothing in between.
        prop_assume!(world.machine.stats() == MachineStats::default());
        let targets: Vec<DeviceId> =
            fleet.iter().filter(|id| world.fleet.contains(id)).cloned().collect();
        let mut new_spec = spec(version);
        if let Some(uptime) = uptime {
            new_spec["uptime"] = json!(uptime);
        }
        let mut digests = NewSpecDigests::new(&new_spec, SpecDigest::of(&new_spec));
        let machine = &world.machine;
        let (planned, _) = plan_devices(&targets, |id| machine.view(id), &mut digests, force);
        prop_assert_eq!(planned.len(), targets.len());

        // Applied as `engine::new_run::commit_run` applies a desired change.
        for device in planned.iter().filter(|d| d.new_generation) {
            world.wants_spec(&device.id, device.generation.get(), new_spec.clone());
        }
        let (published, asked) = (world.published.len(), world.asked.len());
        let run = world.create(targets, force);
        world.settle();
        let outcome = |id: &DeviceId| {
            world.outcomes.get(&run).and_then(|rows| {
                rows.iter().find(|(d, _, _)| d == id).map(|(_, kind, reason)| (*kind, reason.clone()))
            })
        };
        for device in &planned {
            let was_pushed = world.published[published..]
                .iter()
                .any(|(d, g, reason)| *d == device.id && *g == device.generation.get() && *reason == PublishReason::Attempt);
            let was_asked = world.asked[asked..].contains(&device.id);
            let first_step = match device.verdict {
                Verdict::Converged => outcome(&device.id) == Some((OutcomeKind::AlreadyConverged, None)),
                Verdict::Push => was_pushed && outcome(&device.id).is_none(),
                Verdict::Skipped(PlanSkip::NoReport) => was_asked && !was_pushed,
                Verdict::Skipped(PlanSkip::Blocked(blocked)) => {
                    let skipped = Outcome::Skipped(blocked.into());
                    !was_pushed && outcome(&device.id) == Some((OutcomeKind::Skipped, skipped.reason()))
                }
            };
            prop_assert!(
                first_step,
                "{} planned {:?}: pushed {}, asked {}, outcome {:?}",
                device.id, device.verdict, was_pushed, was_asked, outcome(&device.id)
            );
        }
    }
}
