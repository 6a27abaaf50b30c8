//! The real server SIGKILLed mid-run: no report the broker accepted is
//! lost, no run is left unfinished, and a report is acknowledged only once
//! its batch committed.

use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::{DeviceSnapshot, ExpectedOutcome, FleetPlan};
use idem_protocol::TopicRoot;
use idem_tests::{raise_fd_limit, PrivateMosquitto, ProcessServer, ReportWitness, TestDatabase};
use serde_json::json;

use crate::{
    register, run_progress, start_fleet, stored_seqs, take_all_offline, unique_tag,
    wait_all_runs_completed, wait_decided, wait_each_published_since, wait_reports_stored,
    wait_stored_equals_published, wait_witness_saw_final, SERIAL, SERVER_BIN,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_while_200_devices_report_loses_no_report_and_leaves_no_run_unfinished() {
    const DEVICES: usize = 200;
    const DRIFTED: usize = 20;
    const HEARTBEAT: Duration = Duration::from_millis(250);
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let began = Instant::now();
    raise_fd_limit().unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("idem-faults/{tag}")).unwrap();
    // Fixed for the whole test: the restarted process must resume the MQTT
    // session `idem-kill-{tag}` that holds what was published meanwhile.
    let instance = format!("kill-{tag}");
    let witness = ReportWitness::start(&broker, &root).await.unwrap();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &instance,
        &[],
    )
    .await
    .unwrap();

    // The drifted devices apply a push only after 2–3 s, so the run is
    // still in flight when the server dies.
    let plan = FleetPlan::new("kill-", DEVICES)
        .drifted(DRIFTED)
        .apply_latency(Duration::from_secs(2), Duration::from_secs(3))
        .seed(5)
        .build()
        .unwrap();
    register(&server, &plan).await;
    // Half of the converged devices leave (cleanly) while the server is
    // down, so their last report is one the server can only get from its
    // persistent session. The rest, with every drifted device, keep
    // reporting across the restart.
    let (mut leaving, mut staying) = (Vec::new(), Vec::new());
    for device in plan.devices.iter().cloned() {
        let converged = plan.expected(&device.id) == Some(ExpectedOutcome::AlreadyConverged);
        if converged && leaving.len() < DEVICES / 2 {
            leaving.push(device);
        } else {
            staying.push(device);
        }
    }
    let leaving_fleet = start_fleet(&broker, &root, leaving, Some(HEARTBEAT)).await;
    let staying_fleet = start_fleet(&broker, &root, staying, Some(HEARTBEAT)).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;

    let run_id = server.start_run(&json!({"all": true})).await.unwrap();
    let converged = i64::try_from(DEVICES - DRIFTED).unwrap();
    wait_decided(db.pool(), &run_id, converged, Duration::from_secs(20)).await;
    let published_before_kill = witness.reports();
    let highest_at_kill = witness.highest();

    server.kill().unwrap();
    let killed_at = Instant::now();
    let (decided_at_kill, state_at_kill) = run_progress(db.pool(), &run_id).await;
    assert_eq!(
        state_at_kill, "running",
        "the run finished before the kill: this test did not crash the server mid-run"
    );
    assert!(
        decided_at_kill < i64::try_from(DEVICES).unwrap(),
        "{decided_at_kill}"
    );

    // Every leaving device publishes while the server is down: its newest
    // report then exists only in the server's persistent session.
    wait_each_published_since(
        &witness,
        &leaving_fleet,
        &highest_at_kill,
        "while the server was down",
    )
    .await;
    let leaving_final = take_all_offline(&leaving_fleet).await;
    let published_while_down = witness.reports() - published_before_kill;
    for device in &leaving_final {
        let at_kill = highest_at_kill.get(device.id.as_str()).copied();
        assert!(
            Some(device.seq) > at_kill,
            "{} published nothing while the server was down ({:?} at the kill, {} now)",
            device.id,
            at_kill,
            device.seq
        );
    }

    let restarting = Instant::now();
    server.restart().await.unwrap();
    let restart_to_ready = restarting.elapsed();
    let outage = killed_at.elapsed();

    // No run stays unfinished: the crashed one is resumed at start-up (and
    // any run the new process starts itself must end too).
    let runs = wait_all_runs_completed(db.pool(), &server, Duration::from_secs(60)).await;
    let resumed_done = killed_at.elapsed();
    let crashed_run = runs
        .iter()
        .find(|r| r.id.to_string() == run_id)
        .expect("the run started before the kill");
    assert_eq!(crashed_run.target_count, i32::try_from(DEVICES).unwrap());
    assert_eq!(
        crashed_run.decided(),
        crashed_run.target_count,
        "every target has exactly one outcome: {crashed_run:?}"
    );
    assert_eq!(crashed_run.failed, 0, "{crashed_run:?}");
    let undecided: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_targets WHERE outcome IS NULL AND run_id = $1",
    )
    .bind(crashed_run.id)
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(undecided, 0);

    // Heartbeats keep flowing into the restarted server (each staying
    // device publishes again), then the remaining devices leave too and
    // every seq is final.
    let highest_after_restart = witness.highest();
    wait_each_published_since(
        &witness,
        &staying_fleet,
        &highest_after_restart,
        "after the restart",
    )
    .await;
    let staying_final = take_all_offline(&staying_fleet).await;
    let finals: Vec<DeviceSnapshot> = leaving_final.into_iter().chain(staying_final).collect();
    assert_eq!(finals.len(), DEVICES);
    wait_witness_saw_final(&witness, &finals).await;
    wait_stored_equals_published(db.pool(), &server, &finals, Duration::from_secs(30)).await;

    assert!(
        server.is_running(),
        "the restarted server exited\n{}",
        server.log_tail()
    );
    assert_eq!(
        server.panics(),
        Vec::<String>::new(),
        "panics in the server log"
    );
    assert_eq!(witness.invalid(), 0);
    println!(
        "SIGKILL test: outage {outage:?} (restart to ready {restart_to_ready:?}), \
         {published_while_down} reports published while down, crashed run resumed and all \
         {} runs ({:?}) completed {resumed_done:?} after the kill (crashed run: {} already \
         converged, {} provisioned), {} reports seen in total, test took {:?}",
        runs.len(),
        runs.iter().map(|r| r.trigger.as_str()).collect::<Vec<_>>(),
        crashed_run.already_converged,
        crashed_run.provisioned,
        witness.reports(),
        began.elapsed()
    );
    leaving_fleet.shutdown().await.unwrap();
    staying_fleet.shutdown().await.unwrap();
}

/// The guarantee "a report is acknowledged on MQTT only after the batch that
/// holds it has committed", checked where it matters: the server receives
/// reports it cannot commit (another client holds the devices table), the
/// devices then **stop** reporting, and the server is SIGKILLed before any
/// commit. After the restart, every report the broker accepted (and
/// PUBACKed to its device) must be stored: it can only come from the
/// server's persistent session, which keeps exactly the unacknowledged
/// messages. An ingest that acknowledged first would have lost them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_the_broker_accepted_survive_a_server_killed_before_it_could_store_them() {
    const DEVICES: usize = 40;
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    raise_fd_limit().unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("idem-faults/{tag}")).unwrap();
    let instance = format!("ack-{tag}");
    let witness = ReportWitness::start(&broker, &root).await.unwrap();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &instance,
        &[("IDEM_STARTUP_RECONCILE", "false")],
    )
    .await
    .unwrap();
    let plan = FleetPlan::new("ack-", DEVICES).seed(9).build().unwrap();
    register(&server, &plan).await;
    let fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;
    let api = server.api();
    let applied_before = api
        .metric("idem_reports_total{result=\"applied\"}")
        .await
        .unwrap();

    // From here on no report can commit.
    let mut blocker = db.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE devices IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    for id in fleet.device_ids() {
        fleet.request_report(id).unwrap();
    }
    // The devices stop reporting; each one's newest report is final.
    let finals = take_all_offline(&fleet).await;
    wait_witness_saw_final(&witness, &finals).await;
    // The server has taken reports into a batch (it classifies, then waits
    // to commit).
    let deadline = Instant::now() + Duration::from_secs(10);
    while api
        .metric("idem_reports_total{result=\"applied\"}")
        .await
        .unwrap()
        <= applied_before
    {
        assert!(
            Instant::now() < deadline,
            "the server never received the new reports\n{}",
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stored_before_kill = stored_seqs(db.pool()).await;

    server.kill().unwrap();
    blocker.rollback().await.unwrap();
    // Nothing of the new reports was committed before the kill.
    for device in &finals {
        let stored = stored_before_kill
            .get(device.id.as_str())
            .copied()
            .flatten();
        assert!(
            stored.is_some_and(|s| (s as u64) < device.seq),
            "{}: stored {stored:?} before the kill, final {}",
            device.id,
            device.seq
        );
    }
    server.restart().await.unwrap();
    wait_stored_equals_published(db.pool(), &server, &finals, Duration::from_secs(20)).await;
    assert_eq!(server.panics(), Vec::<String>::new());
    fleet.shutdown().await.unwrap();
}
