//! The real server SIGKILLed in the middle of a rollout's wave: the
//! restarted process goes on with the rollout where it was, and no device
//! is pushed twice for the new generation — counted by an independent
//! subscriber on every `desired` topic.

use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use idem_protocol::TopicRoot;
use idem_tests::{raise_fd_limit, PrivateMosquitto, ProcessServer, PushWitness, TestDatabase};
use serde_json::json;

use crate::{
    register, run_progress, start_fleet, unique_tag, wait_all_runs_completed, wait_decided,
    wait_reports_stored, SERIAL, SERVER_BIN,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_wave_goes_on_with_the_rollout_and_pushes_no_device_twice() {
    const DEVICES: usize = 200;
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
    let witness = PushWitness::start(&broker, &root).await.unwrap();
    // 40 pushes a second and devices that take 0.2–0.4 s to apply one:
    // the second wave (180 devices) takes seconds, so the kill lands in it.
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("rollout-kill-{tag}"),
        &[("IDEM_PUSH_RATE", "40")],
    )
    .await
    .unwrap();
    let plan = FleetPlan::new("wave-", DEVICES)
        .apply_latency(Duration::from_millis(200), Duration::from_millis(400))
        .seed(3)
        .build()
        .unwrap();
    register(&server, &plan).await;
    let fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;

    let mut new = plan.desired_spec.clone();
    new["firmware"] = json!("9.9.9");
    let (status, started) = server
        .post(
            "/v1/desired",
            &json!({"all": true, "spec": new, "rollout": {"waves": ["10%", "100%"]}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    // The first wave's 20 and some of the second's.
    wait_decided(db.pool(), &run_id, 60, Duration::from_secs(30)).await;
    server.kill().unwrap();
    let (decided_at_kill, state_at_kill) = run_progress(db.pool(), &run_id).await;
    assert_eq!(
        state_at_kill, "running",
        "the rollout finished before the kill: this test did not crash the server mid-wave"
    );
    assert!(decided_at_kill < DEVICES as i64, "{decided_at_kill}");
    let pushed_at_kill: u32 = witness.pushes().unwrap().values().sum();

    server.restart().await.unwrap();
    let runs = wait_all_runs_completed(db.pool(), &server, Duration::from_secs(60)).await;
    let rollout_run = runs
        .iter()
        .find(|r| r.id.to_string() == run_id)
        .expect("the rollout's run");
    assert_eq!(
        rollout_run.provisioned, DEVICES as i32,
        "every device provisioned once: {rollout_run:?}"
    );
    let (status, run) = server.get(&format!("/v1/runs/{run_id}")).await.unwrap();
    assert_eq!(status, 200, "{run}");
    assert_eq!(run["rollout"]["state"], "completed", "{run}");
    assert_eq!(run["rollout"]["waves"][0]["provisioned"], 20, "{run}");
    assert_eq!(run["rollout"]["waves"][1]["provisioned"], 180, "{run}");

    // Generation 2 is the change; the witness saw exactly one push of it
    // per device, across the kill.
    let pushes = witness.pushes().unwrap();
    let twice: Vec<_> = pushes
        .iter()
        .filter(|((_, generation), n)| *generation == 2 && **n > 1)
        .collect();
    assert!(
        twice.is_empty(),
        "devices pushed twice for generation 2: {twice:?}"
    );
    let pushed: Vec<_> = pushes.keys().filter(|(_, g)| *g == 2).collect();
    assert_eq!(pushed.len(), DEVICES, "{pushes:?}");
    assert!(
        pushes.keys().all(|(_, g)| *g == 2),
        "a push of another generation: {pushes:?}"
    );
    assert_eq!(
        server.panics(),
        Vec::<String>::new(),
        "panics in the server log"
    );
    println!(
        "rollout SIGKILL test: killed with {decided_at_kill} of {DEVICES} decided and \
         {pushed_at_kill} pushed; resumed and completed, {} pushes in all; took {:?}",
        pushes.values().sum::<u32>(),
        began.elapsed()
    );
    fleet.shutdown().await.unwrap();
}
