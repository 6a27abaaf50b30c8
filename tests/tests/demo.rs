//! The newcomer demo, scaled down, end to end inside the test suite: a real
//! server on a private broker and a fresh database, `device-sim`'s demo
//! library registering, connecting and running 500 simulated devices, and
//! the simulator's ground-truth check over every outcome.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_device_sim::{
    run_demo, BrokerAddr, DemoError, DemoSettings, FleetPlan, SecretString, DEFAULT_REJECT_MESSAGE,
};
use idem_tests::{Scenario, ServerSettings};

fn settings_for(scenario: &Scenario, plan: idem_device_sim::Plan) -> DemoSettings {
    let mut settings = DemoSettings::new(
        scenario.server.url(""),
        plan,
        BrokerAddr::new(scenario.broker.host(), scenario.broker.port()),
        scenario.server.topic_root.clone(),
    );
    settings.timeout = Duration::from_secs(30);
    settings.register_chunk = 100;
    settings.auth.token = scenario.server.token().map(SecretString::new);
    settings
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_over_500_devices_reports_exact_counts_and_matches_the_ground_truth() {
    // One attempt per device (the harness default): a rejecting device fails
    // at its first rejection instead of after retries.
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("demo-", 500)
        .drifted(5)
        .rejecting(2)
        .seed(11)
        .build()
        .unwrap();
    let rejecting = plan.ids_expecting(idem_device_sim::ExpectedOutcome::Failed);

    let started = Instant::now();
    let demo = run_demo(settings_for(&scenario, plan), &()).await.unwrap();
    let report = &demo.report;
    println!(
        "scaled-down demo: {:?} total; connect {:.2} s, reports stored {:.2} s, run {:.3} s",
        started.elapsed(),
        report.timings.connect_s,
        report.timings.reports_stored_s,
        report.timings.run_s
    );

    assert_eq!(
        report.summary, "493 already converged, 5 provisioned, 2 failed",
        "{report:#?}"
    );
    assert_eq!(report.counts.already_converged, 493);
    assert_eq!(report.counts.provisioned, 5);
    assert_eq!(report.counts.failed, 2);
    assert!(report.check.passed(), "{:#?}", report.check.mismatches);
    assert_eq!(report.check.checked, 500);
    assert!(report.passed());
    assert_eq!(report.targeting, "all");

    // The failed devices are the rejecting ones, with the device's reason.
    let failed: Vec<&str> = report.failed.iter().map(|f| f.device.as_str()).collect();
    let rejecting: Vec<&str> = rejecting.iter().map(|id| id.as_str()).collect();
    assert_eq!(failed, rejecting);
    for f in &report.failed {
        assert_eq!(
            f.reason.as_deref(),
            Some(format!("rejected by device: {DEFAULT_REJECT_MESSAGE}").as_str())
        );
    }
    // Convergence was measured on the simulator for the five pushed devices.
    assert_eq!(report.timings.convergence.unwrap().samples, 5);
    demo.fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_demo_with_the_same_devices_is_refused_because_their_state_is_known() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("again-", 20)
        .drifted(2)
        .seed(3)
        .build()
        .unwrap();
    let first = run_demo(settings_for(&scenario, plan.clone()), &())
        .await
        .unwrap();
    assert!(first.report.passed(), "{:#?}", first.report);
    first.fleet.shutdown().await.unwrap();

    let err = run_demo(settings_for(&scenario, plan), &())
        .await
        .unwrap_err();
    assert!(
        matches!(err, DemoError::AlreadyRegistered { existing: 20, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("--id-prefix"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_on_a_server_with_other_devices_runs_only_its_own_fleet() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let first = FleetPlan::new("first-", 10).seed(1).build().unwrap();
    let earlier = run_demo(settings_for(&scenario, first), &()).await.unwrap();
    earlier.fleet.shutdown().await.unwrap();

    // The first fleet is now offline on the server; a run over "all" would
    // report it skipped. The demo targets its own label instead.
    let plan = FleetPlan::new("second-", 30)
        .drifted(3)
        .seed(2)
        .build()
        .unwrap();
    let demo = run_demo(settings_for(&scenario, plan), &()).await.unwrap();
    assert_eq!(demo.report.targeting, "label");
    assert_eq!(
        demo.report.summary,
        "27 already converged, 3 provisioned, 0 failed"
    );
    assert!(demo.report.passed(), "{:#?}", demo.report.check);
    demo.fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_rollout_stops_on_its_gate_says_why_and_every_device_matches_the_ground_truth() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    // 400 devices: 200 drifted and 20 rejecting need a push; 180 are
    // converged and in no wave.
    let plan = FleetPlan::new("canary-", 400)
        .drifted(200)
        .rejecting(20)
        .seed(7)
        .build()
        .unwrap();
    let mut settings = settings_for(&scenario, plan);
    settings.rollout = Some(idem_device_sim::DemoRollout::parse("1%,10%,100%", 0.02).unwrap());
    let demo = run_demo(settings, &()).await.unwrap();
    let report = &demo.report;
    let rollout = report.rollout.as_ref().expect("a rollout report");
    assert_eq!(report.counts.already_converged, 180, "{report:#?}");
    let sizes: Vec<u64> = rollout.waves.iter().map(|w| w.size).collect();
    // Cumulative 1 %, 10 %, 100 % of the 220 that need a push, rounded up.
    assert_eq!(sizes, [3, 19, 198], "{rollout:#?}");
    let paused = rollout
        .paused
        .as_ref()
        .expect("one rejection in any wave breaches 2 %");
    assert_eq!(paused.gate.as_deref(), Some("max_failure_ratio"));
    assert_eq!(paused.limit, Some(0.02));
    assert!(paused.observed.unwrap() > 0.02, "{paused:?}");
    assert!(rollout.aborted);
    // Waves after the paused one pushed nothing.
    for wave in &rollout.waves[paused.wave as usize + 1..] {
        assert_eq!(wave.provisioned + wave.failed, 0, "{wave:?}");
        assert_eq!(wave.skipped, wave.size, "{wave:?}");
    }
    assert!(report.counts.skipped > 0, "{report:#?}");
    assert!(report.passed(), "{:#?}", report.check.mismatches);
    demo.fleet.shutdown().await.unwrap();
}
