//! Two instances on one broker and one database. The engine's holder (A)
//! learns of the other instance's device writes only through its own
//! writes (notifications off, the catch-up every ten minutes), so its cache
//! lags whatever is posted to the other instance (B). Decisions are made on
//! fresh data all the same:
//! - desired changes posted to B while A pushes a fleet-wide change slowly
//!   (5 a second) to devices that never answer are never overtaken by a
//!   push or retained refresh of an older generation from A: one that
//!   leaves after a change was committed carries that change's generation
//!   or a later one;
//! - a run A creates after B changed some devices, and a run B creates that
//!   A carries, never count a device `already_converged` (or record any
//!   outcome) against the spec B replaced: every outcome is for the
//!   generation desired when its run was created.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use idem_tests::{ProcessServer, PushWitness};
use serde_json::json;
use sqlx::PgPool;

use crate::{owns, private_services, register, start_fleet, SERIAL, SERVER_BIN};

/// Few enough that the retained refreshes each change brings (one per
/// device whose queued attempt it superseded) do not delay the pushes
/// behind them; enough that the paced pushes never run out.
const DEVICES: usize = 40;
/// Changes posted to B while A pushes.
const CHANGES: u64 = 8;
/// A push that arrives this soon after a change's call returned may have
/// left before the change committed (and waited in the clients and the
/// broker on a busy machine). Pushes leave every 200 ms: without the hold
/// on desired changes, one that went out on a cache the change overtook
/// arrives up to that long after it.
const IN_FLIGHT: Duration = Duration::from_millis(80);

/// A, the engine's holder whose cache follows B only through its own
/// writes, and B, started in that order with `common` settings for both.
async fn lagging_holder_and_other(
    db_url: &str,
    broker_url: &str,
    root: &idem_protocol::TopicRoot,
    tag: &str,
    common: &[(&str, &str)],
) -> (ProcessServer, ProcessServer) {
    let mut a_env = common.to_vec();
    a_env.extend([
        ("IDEM_FOLLOW_NOTIFICATIONS", "false"),
        ("IDEM_FOLLOW_EVERY", "10m"),
    ]);
    let a = ProcessServer::start(
        Path::new(SERVER_BIN),
        db_url,
        broker_url,
        root,
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
        db_url,
        broker_url,
        root,
        &format!("b-{tag}"),
        common,
    )
    .await
    .unwrap();
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_posted_to_another_instance_is_never_overtaken_by_a_push_of_an_older_generation() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-fresh").await;
    let common = [("IDEM_PUSH_TIMEOUT", "60s"), ("IDEM_PUSH_RATE", "5")];
    let (a, b) = lagging_holder_and_other(db.url(), &broker.url(), &root, &tag, &common).await;
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

/// Devices in each part of the converged-fleet test.
const PART: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_carried_by_an_instance_whose_cache_lags_never_count_a_device_converged_on_a_replaced_spec(
) {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-fresh-converged").await;
    let (a, b) = lagging_holder_and_other(db.url(), &broker.url(), &root, &tag, &[]).await;
    let plan = FleetPlan::new("fresh-c-", 3 * PART)
        .seed(46)
        .build()
        .unwrap();
    register(&a, &plan).await;
    let _fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    crate::wait_reports_stored(db.pool(), 3 * PART, Duration::from_secs(30)).await;
    let witness = PushWitness::start(&broker, &root).await.unwrap();
    let mut ids: Vec<String> = plan.devices.iter().map(|d| d.id.to_string()).collect();
    ids.sort();
    let replaced_on_b = &ids[..PART];
    let changed_by_a_run_on_b = &ids[PART..2 * PART];
    let mut spec = plan.desired_spec.clone();
    spec["firmware"] = json!("fresh-converged-2");

    // B replaces the spec of the first part (no run); A, whose cache still
    // holds the old spec, re-checks the whole fleet at once.
    let body: Vec<_> = replaced_on_b
        .iter()
        .map(|id| json!({"id": id, "spec": spec}))
        .collect();
    let (status, answer) = b.post("/v1/devices", &json!(body)).await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["desired_changed"], json!(PART), "{answer}");
    let recheck = a.start_run(&json!({"all": true})).await.unwrap();
    let recheck_run = a
        .wait_run_completed(&recheck, Duration::from_secs(30))
        .await
        .unwrap();

    let expected_recheck: BTreeMap<String, (String, i64)> = ids
        .iter()
        .map(|id| {
            let expected = if replaced_on_b.contains(id) {
                ("provisioned", 2)
            } else {
                ("already_converged", 1)
            };
            (id.clone(), (expected.0.to_owned(), expected.1))
        })
        .collect();
    assert_eq!(
        outcomes(db.pool(), &recheck).await,
        expected_recheck,
        "the re-check A created after B replaced the first part's spec"
    );

    // B changes the second part in a run of its own, which A carries.
    let (status, answer) = b
        .post(
            "/v1/desired",
            &json!({"devices": changed_by_a_run_on_b, "spec": spec}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let change = answer["run_id"].as_str().unwrap().to_owned();
    let change_run = a
        .wait_run_completed(&change, Duration::from_secs(30))
        .await
        .unwrap();

    let changed = |id: &String| replaced_on_b.contains(id) || changed_by_a_run_on_b.contains(id);
    let expected_change: BTreeMap<String, (String, i64)> = changed_by_a_run_on_b
        .iter()
        .map(|id| (id.clone(), ("provisioned".to_owned(), 2)))
        .collect();
    let old_pushes: Vec<(String, u64)> = witness
        .arrivals()
        .unwrap()
        .into_iter()
        .filter(|(_, device, generation)| !changed(device) || *generation != 2)
        .map(|(_, device, generation)| (device, generation))
        .collect();
    println!(
        "converged on fresh data: the re-check on the lagging instance {}, the other \
         instance's change carried by it {}",
        recheck_run["counts"], change_run["counts"]
    );
    assert_eq!(
        outcomes(db.pool(), &change).await,
        expected_change,
        "B's change of the second part, carried by A"
    );
    assert_eq!(
        old_pushes,
        Vec::new(),
        "pushes of a replaced or unchanged spec"
    );

    // A device registered through B is known to A at once, though A's cache
    // has not followed B yet: a call naming it catches the cache up.
    let (status, answer) = b
        .post(
            "/v1/devices",
            &json!([{"id": "fresh-c-late", "spec": spec}]),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = a
        .api()
        .put(
            "/v1/devices/fresh-c-late/desired",
            &json!({"spec": plan.desired_spec}),
        )
        .await
        .unwrap();
    assert_eq!(
        status, 200,
        "a device registered through the other instance, named on the lagging one: {answer}"
    );
    assert_eq!(a.panics(), Vec::<String>::new());
    assert_eq!(b.panics(), Vec::<String>::new());
}

/// Every target's outcome in run `run_id`, with the generation it was for.
async fn outcomes(pool: &PgPool, run_id: &str) -> BTreeMap<String, (String, i64)> {
    let id: uuid::Uuid = run_id.parse().unwrap();
    let rows: Vec<(String, Option<String>, Option<i64>)> =
        sqlx::query_as("SELECT device_id, outcome, generation FROM run_outcomes WHERE run_id = $1")
            .bind(id)
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter()
        .map(|(device, outcome, generation)| {
            (
                device,
                (
                    outcome.unwrap_or_else(|| "none".to_owned()),
                    generation.unwrap_or(0),
                ),
            )
        })
        .collect()
}
