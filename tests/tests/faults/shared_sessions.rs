//! Two instances sharing the fleet's subscriptions (`--share-group`): the
//! broker hands each report to one of them. One is SIGKILLed and never
//! restarted; the broker goes on queueing its share in its persistent
//! session. The survivor drains that session once the dead instance's
//! claim is stale, so every report the broker accepted is stored.

use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::{DeviceSnapshot, FleetPlan};
use idem_tests::{ProcessServer, ReportWitness};

use crate::{
    private_services, register, start_fleet, take_all_offline, wait_each_published_since,
    wait_reports_stored, wait_stored_equals_published, wait_witness_saw_final, SERIAL, SERVER_BIN,
};

/// The value of an unlabelled counter in a Prometheus text exposition.
fn counter(exposition: &str, name: &str) -> f64 {
    idem_device_sim::api::metric_value(exposition, name)
        .unwrap()
        .unwrap_or_else(|| panic!("{name} is not in the exposition"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_queued_for_a_killed_instance_that_never_returns_are_stored_by_the_survivor() {
    const DEVICES: usize = 60;
    const HEARTBEAT: Duration = Duration::from_millis(200);
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-shared").await;
    let group = format!("g{tag}");
    let env = [
        ("IDEM_SHARE_GROUP", group.as_str()),
        ("IDEM_INSTANCE_LEASE", "2s"),
    ];
    let witness = ReportWitness::start(&broker, &root).await.unwrap();
    let survivor = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("survivor-{tag}"),
        &env,
    )
    .await
    .unwrap();
    let plan = FleetPlan::new("shared-", DEVICES).seed(7).build().unwrap();
    register(&survivor, &plan).await;
    // Started after the registration, so its fleet cache holds the devices.
    let mut doomed = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("doomed-{tag}"),
        &env,
    )
    .await
    .unwrap();
    let fleet = start_fleet(&broker, &root, plan.devices.clone(), Some(HEARTBEAT)).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;

    doomed.kill().unwrap();
    let killed_at = Instant::now();
    // Every device reports again while the dead instance's claim is still
    // live: part of those reports wait in its session.
    let highest_at_kill = witness.highest();
    wait_each_published_since(&witness, &fleet, &highest_at_kill, "after the kill").await;
    let finals: Vec<DeviceSnapshot> = take_all_offline(&fleet).await;
    wait_witness_saw_final(&witness, &finals).await;
    wait_stored_equals_published(db.pool(), &survivor, &finals, Duration::from_secs(30)).await;

    let stored_at = killed_at.elapsed();
    // The claim is deleted once the drained session is removed too.
    let deadline = Instant::now() + Duration::from_secs(15);
    let metrics = loop {
        let metrics = survivor.api().metrics().await.unwrap();
        if counter(&metrics, "idem_sessions_drained_total") >= 1.0 {
            break metrics;
        }
        assert!(
            Instant::now() < deadline,
            "the survivor drained no session 15 s after the reports were stored\n{}",
            survivor.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(counter(&metrics, "idem_sessions_drained_total"), 1.0);
    let drained = counter(&metrics, "idem_drained_messages_total");
    assert!(
        drained > 0.0,
        "the dead instance's session held nothing: the test did not exercise the drain"
    );
    let (status, cluster) = survivor.get("/v1/cluster").await.unwrap();
    assert_eq!(status, 200, "{cluster}");
    let names: Vec<&str> = cluster["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert_eq!(names, [format!("survivor-{tag}")], "{cluster}");
    assert_eq!(survivor.panics(), Vec::<String>::new());
    println!(
        "shared sessions: {} reports seen, {drained} waited in the killed instance's session, \
         all stored {stored_at:?} after the kill",
        witness.reports(),
    );
    fleet.shutdown().await.unwrap();
}
