//! Two instances on one broker and one database. The engine's holder (A)
//! learns of the other instance's device writes only through its own
//! writes (notifications off, the catch-up every ten minutes) and pushes a
//! fleet-wide change slowly (5 a second) to devices that never answer.
//! Desired changes posted to the other instance (B) meanwhile are never
//! overtaken by a push of an older generation from A: a push that leaves
//! after a change was committed carries that change's generation or a
//! later one.

use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use idem_tests::{ProcessServer, PushWitness};
use serde_json::json;

use crate::{owns, private_services, register, start_fleet, SERIAL, SERVER_BIN};

const DEVICES: usize = 200;
/// Changes posted to B while A pushes.
const CHANGES: u64 = 8;
/// A push that arrives this soon after a change's call returned may have
/// left before the change committed (and waited in the clients on a busy
/// machine). Pushes leave every 200 ms: one that went out on a cache the
/// change overtook arrives up to that long after it.
const IN_FLIGHT: Duration = Duration::from_millis(80);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_posted_to_another_instance_is_never_overtaken_by_a_push_of_an_older_generation() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-fresh").await;
    let common = [("IDEM_PUSH_TIMEOUT", "60s"), ("IDEM_PUSH_RATE", "5")];
    let mut a_env = common.to_vec();
    a_env.extend([
        ("IDEM_FOLLOW_NOTIFICATIONS", "false"),
        ("IDEM_FOLLOW_EVERY", "10m"),
    ]);
    let a = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("a-{tag}"),
        &a_env,
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !owns(&a, "engine").await {
        assert!(
            Instant::now() < deadline,
            "the first instance never took the engine"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("b-{tag}"),
        &common,
    )
    .await
    .unwrap();
    let plan = FleetPlan::new("fresh-", DEVICES)
        .ignoring_pushes(DEVICES)
        .seed(46)
        .build()
        .unwrap();
    register(&a, &plan).await;
    let _fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    crate::wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;
    let witness = PushWitness::start(&broker, &root).await.unwrap();

    // Registration made generation 1; each change after it is the next.
    let change = |n: u64| {
        let mut spec = plan.desired_spec.clone();
        spec["firmware"] = json!(format!("fresh-{n}"));
        json!({"all": true, "spec": spec})
    };
    let (status, body) = a.post("/v1/desired", &change(2)).await.unwrap();
    assert_eq!(status, 200, "{body}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut committed: Vec<(Instant, u64)> = Vec::new();
    for generation in 3..3 + CHANGES {
        let (status, body) = b.post("/v1/desired", &change(generation)).await.unwrap();
        assert_eq!(status, 200, "{body}");
        committed.push((Instant::now(), generation));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let arrivals = witness.arrivals().unwrap();
    let first_change = committed[0].0;
    let after = arrivals
        .iter()
        .filter(|(at, _, _)| *at > first_change)
        .count();
    assert!(
        after >= CHANGES as usize,
        "only {after} pushes after the first change on the other instance: nothing tested"
    );
    let overtaken: Vec<String> = arrivals
        .iter()
        .filter_map(|(at, device, generation)| {
            let newest = committed
                .iter()
                .filter(|(done, _)| *done + IN_FLIGHT <= *at)
                .map(|(_, g)| *g)
                .max()?;
            (*generation < newest).then(|| {
                format!(
                    "{device} got generation {generation} {:?} after generation {newest} was committed",
                    at.duration_since(committed.iter().find(|(_, g)| *g == newest).unwrap().0)
                )
            })
        })
        .collect();
    let metrics = a.api().metrics().await.unwrap();
    let withdrawn = idem_device_sim::api::metric_value(&metrics, "idem_stale_pushes_total")
        .unwrap()
        .unwrap_or(0.0);
    println!(
        "decisions on fresh data: {} pushes, {after} after the first change on the other \
         instance, {withdrawn} withdrawn as overtaken, {} overtaken pushes sent",
        arrivals.len(),
        overtaken.len()
    );
    assert!(
        overtaken.is_empty(),
        "pushes of an older generation: {overtaken:#?}"
    );
    assert_eq!(a.panics(), Vec::<String>::new());
    assert_eq!(b.panics(), Vec::<String>::new());
}
