//! Plans end to end against real PostgreSQL and a private Mosquitto: a plan
//! says exactly what a change would do, device by device and field by
//! field, while changing nothing; applying it does what it said; a plan the
//! fleet moved away from is refused.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use idem_device_sim::{FleetPlan, OfflineMode};
use idem_protocol::DeviceId;
use idem_tests::{outcome_of, Scenario, ServerSettings};
use serde_json::{json, Value};

/// Every table of the test database with its row count, and the event
/// log's last sequence number (as reserved).
async fn footprint(pool: &sqlx::PgPool) -> (BTreeMap<String, i64>, i64) {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut counts = BTreeMap::new();
    for table in tables {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{table}\""))
            .fetch_one(pool)
            .await
            .unwrap();
        counts.insert(table, n);
    }
    let last: i64 = sqlx::query_scalar("SELECT last FROM event_sequence")
        .fetch_one(pool)
        .await
        .unwrap();
    (counts, last)
}

/// Waits until the footprint stays the same for a second (the server has
/// written what the fleet's reports and connections ask for).
async fn settled_footprint(pool: &sqlx::PgPool) -> (BTreeMap<String, i64>, i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = footprint(pool).await;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = footprint(pool).await;
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// Every device of a plan, paged through `GET /v1/plans/{id}/devices`.
async fn all_planned(scenario: &Scenario, plan_id: &str, change: &str) -> Vec<Value> {
    let mut devices = Vec::new();
    let mut after = String::new();
    loop {
        let path = format!("/v1/plans/{plan_id}/devices?change={change}&limit=500{after}");
        let (status, page) = scenario.server.get(&path).await.unwrap();
        assert_eq!(status, 200, "{page}");
        devices.extend(page["devices"].as_array().unwrap().iter().cloned());
        match page["next_after"].as_str() {
            Some(next) => after = format!("&after={next}"),
            None => return devices,
        }
    }
}

/// How a device's report strays from the desired spec.
type Drift = fn(&mut Value);

fn paths(device: &Value) -> BTreeSet<(String, String)> {
    device["diff"]
        .as_array()
        .unwrap_or_else(|| panic!("no diff: {device}"))
        .iter()
        .map(|c| {
            (
                c["path"].as_str().unwrap().to_owned(),
                c["change"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn set(items: &[(&str, &str)]) -> BTreeSet<(String, String)> {
    items
        .iter()
        .map(|(p, c)| ((*p).to_owned(), (*c).to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_over_two_thousand_devices_is_exact_changes_nothing_and_applies_only_while_fresh() {
    // Drift runs wait long enough that the device which reports a change
    // below is not brought back before the plan is applied (a busy
    // machine's polling took longer than the default 200 ms).
    let scenario = Scenario::start(ServerSettings {
        debounce: Duration::from_secs(20),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let mut fleet_plan = FleetPlan::new("plan-", 2_000).seed(3).build().unwrap();
    let desired = fleet_plan.desired_spec.clone();
    let mut next = desired.clone();
    next["firmware"] = json!("2.5.0");

    // Five devices drifted, each in another field; one of them drifted to
    // exactly the firmware the change brings.
    let drifts: [(usize, Drift); 5] = [
        (11, |s| s["telemetry"]["interval_s"] = json!(30)),
        (222, |s| s["features"]["debug_log"] = json!(true)),
        (333, |s| {
            s.as_object_mut().unwrap().remove("version");
        }),
        (444, |s| s["features"]["beta"] = json!("on")),
        (1555, |s| s["firmware"] = json!("2.5.0")),
    ];
    for (index, drift) in &drifts {
        drift(&mut fleet_plan.devices[*index].spec);
    }
    let id_at = |i: usize| fleet_plan.devices[i].id.to_string();
    let offline_id = id_at(1999);
    let fleet = scenario
        .register_and_start(&fleet_plan, 2_000)
        .await
        .unwrap();
    fleet
        .take_offline(&DeviceId::parse(&offline_id).unwrap(), OfflineMode::Clean)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, device) = scenario
            .server
            .get(&format!("/v1/devices/{offline_id}"))
            .await
            .unwrap();
        if device["online"] == json!(false) {
            break;
        }
        assert!(Instant::now() < deadline, "never offline: {device}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let before = settled_footprint(scenario.db.pool()).await;
    let (status, plan) = scenario
        .server
        .post("/v1/plans", &json!({"all": true, "spec": next}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{plan}");
    let plan_id = plan["plan_id"].as_str().unwrap().to_owned();
    assert_eq!(
        plan["counts"],
        json!({
            "targets": 2000, "already_converged": 1, "push": 1998, "skipped": 1,
            "skipped_by_reason": {"offline": 1, "quarantined": 0, "exempt": 0, "no_report": 0}
        }),
        "{plan}"
    );
    assert_eq!(plan["state"], "open");
    assert_eq!(plan["devices"].as_array().unwrap().len(), 100, "first page");

    let pushes = all_planned(&scenario, &plan_id, "push").await;
    assert_eq!(pushes.len(), 1998);
    let firmware = ("firmware", "changed");
    let expected_drift: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::from([
        (
            id_at(11),
            set(&[firmware, ("telemetry.interval_s", "changed")]),
        ),
        (
            id_at(222),
            set(&[firmware, ("features.debug_log", "changed")]),
        ),
        (id_at(333), set(&[firmware, ("version", "added")])),
        (id_at(444), set(&[firmware, ("features.beta", "removed")])),
    ]);
    for device in &pushes {
        let id = device["device_id"].as_str().unwrap();
        let expected = expected_drift
            .get(id)
            .cloned()
            .unwrap_or_else(|| set(&[firmware]));
        assert_eq!(paths(device), expected, "{device}");
        assert_eq!(device["generation"], 2, "{device}");
        assert_eq!(device["unchanged"], false, "{device}");
    }
    let firmware_change = pushes[0]["diff"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["path"] == "firmware")
        .unwrap()
        .clone();
    assert_eq!(
        firmware_change,
        json!({"path": "firmware", "change": "changed", "old": "2.4.1", "new": "2.5.0", "ignored": false})
    );
    let converged = all_planned(&scenario, &plan_id, "converged").await;
    assert_eq!(converged.len(), 1);
    assert_eq!(converged[0]["device_id"], id_at(1555));
    assert_eq!(converged[0]["diff"], json!([]));
    let skipped = all_planned(&scenario, &plan_id, "skipped").await;
    assert_eq!(skipped.len(), 1);
    assert_eq!(
        (&skipped[0]["device_id"], &skipped[0]["reason"]),
        (&json!(offline_id), &json!("offline"))
    );

    // Planning and reading the plan wrote nothing but the plan itself.
    let (mut after, last_after) = footprint(scenario.db.pool()).await;
    let (mut before, last_before) = before;
    assert_eq!(
        after.remove("plans"),
        before.remove("plans").map(|n| n + 1),
        "the plan is kept in the database"
    );
    assert_eq!(
        (after, last_after),
        (before, last_before),
        "row counts and the last event seq"
    );

    // Applying it pushes to exactly the devices it listed.
    let (status, started) = scenario
        .server
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    let run = scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(run["plan_id"], json!(plan_id), "{run}");
    assert_eq!(
        run["summary"],
        "1 already converged, 1,998 provisioned, 0 failed, 1 skipped"
    );
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    let provisioned: BTreeSet<String> = outcomes
        .iter()
        .filter(|(_, row)| {
            outcome_of(row).unwrap() == Some(idem_protocol::OutcomeKind::Provisioned)
        })
        .map(|(id, _)| id.clone())
        .collect();
    let listed: BTreeSet<String> = pushes
        .iter()
        .map(|d| d["device_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(provisioned, listed);
    let (_, shown) = scenario
        .server
        .get(&format!("/v1/plans/{plan_id}"))
        .await
        .unwrap();
    assert_eq!(
        (&shown["state"], &shown["applied_run"]),
        (&json!("applied"), &json!(run_id))
    );

    // Applying it again is refused.
    let (status, refused) = scenario
        .server
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "plan_stale", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("applied already"),
        "{refused}"
    );

    // A plan made before one device reported a change is refused, saying so.
    let mut third = next.clone();
    third["version"] = json!("2026.1");
    let (status, plan) = scenario
        .server
        .post("/v1/plans", &json!({"all": true, "spec": third}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{plan}");
    let plan_id = plan["plan_id"].as_str().unwrap().to_owned();
    let moved = DeviceId::parse(&id_at(500)).unwrap();
    let seq_of = || async {
        let (_, device) = scenario
            .server
            .get(&format!("/v1/devices/{moved}"))
            .await
            .unwrap();
        device["reported"]["seq"].as_u64()
    };
    let seq_before = seq_of().await;
    let mut local = next.clone();
    local["features"]["ota"] = json!(false);
    fleet.set_local_spec(&moved, local).unwrap();
    fleet.request_report(&moved).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while seq_of().await == seq_before {
        assert!(
            Instant::now() < deadline,
            "the device's report never arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, refused) = scenario
        .server
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "plan_stale", "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("1 device reported a change since the plan")
            && message.ends_with("re-plan"),
        "{message}"
    );
    let (_, desired_now) = scenario
        .server
        .get(&format!("/v1/devices/{}", id_at(0)))
        .await
        .unwrap();
    assert_eq!(
        desired_now["desired"]["spec"], next,
        "a refused plan changes no desired state"
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_refuse_what_they_cannot_do_with_the_apis_error_answers() {
    let settings = ServerSettings {
        plan_ttl: Duration::from_secs(1),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let fleet_plan = FleetPlan::new("refusal-", 3).build().unwrap();
    scenario
        .register(&fleet_plan.devices, &fleet_plan.desired_spec)
        .await
        .unwrap();
    let server = &scenario.server;

    // A selector that matches nothing is a plan of nothing, not an error.
    let (status, empty) = server
        .post(
            "/v1/plans",
            &json!({"selector": {"labels": {"site": "nowhere"}}, "spec": {"a": 1}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{empty}");
    assert_eq!(empty["counts"]["targets"], 0, "{empty}");
    assert_eq!(empty["devices"], json!([]));

    let unknown = uuid::Uuid::now_v7();
    for path in [
        format!("/v1/plans/{unknown}"),
        format!("/v1/plans/{unknown}/devices"),
    ] {
        let (status, answer) = server.get(&path).await.unwrap();
        assert_eq!(
            (status, &answer["error"]["code"]),
            (404, &json!("unknown_plan")),
            "{answer}"
        );
    }
    let (status, answer) = server
        .post(&format!("/v1/plans/{unknown}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, &answer["error"]["code"]),
        (404, &json!("unknown_plan"))
    );
    let (status, answer) = server.get("/v1/plans/not-a-uuid").await.unwrap();
    assert_eq!(
        (status, &answer["error"]["code"]),
        (400, &json!("invalid_plan_id"))
    );
    let (status, answer) = server
        .post("/v1/plans", &json!({"all": true}))
        .await
        .unwrap();
    assert_eq!(
        (status, &answer["error"]["code"]),
        (400, &json!("missing_spec"))
    );

    // A viewer reads plans and makes none.
    let viewer = server
        .client_for_role("plan-viewer", "viewer")
        .await
        .unwrap();
    let (status, answer) = viewer
        .post("/v1/plans", &json!({"all": true, "spec": {"a": 1}}))
        .await
        .unwrap();
    assert_eq!(status, 403, "{answer}");
    let plan_id = empty["plan_id"].as_str().unwrap();
    let (status, _) = viewer.get(&format!("/v1/plans/{plan_id}")).await.unwrap();
    assert_eq!(status, 200);
    let (status, _) = viewer
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 403);

    // Past its lifetime a plan is refused as expired, and shown so.
    let (status, plan) = server
        .post("/v1/plans", &json!({"all": true, "spec": {"a": 2}}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{plan}");
    let plan_id = plan["plan_id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let (status, answer) = server
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, &answer["error"]["code"]),
        (410, &json!("plan_expired")),
        "{answer}"
    );
    let (_, shown) = server.get(&format!("/v1/plans/{plan_id}")).await.unwrap();
    assert_eq!(shown["state"], "expired");
    let (_, device) = server
        .get(&format!("/v1/devices/{}", fleet_plan.devices[0].id))
        .await
        .unwrap();
    assert_eq!(
        device["desired"]["generation"], 1,
        "an expired plan changes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_plans_never_evict_anothers_and_a_full_book_refuses_the_next_plan() {
    use idem_server::config::{MAX_PLANS_KEPT, MAX_PLANS_PER_AUTHOR};
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let fleet_plan = FleetPlan::new("kept-", 2).build().unwrap();
    scenario
        .register(&fleet_plan.devices, &fleet_plan.desired_spec)
        .await
        .unwrap();
    let server = &scenario.server;
    let make = |client: idem_tests::ApiClient| async move {
        let (status, made) = client
            .post("/v1/plans", &json!({"all": true, "spec": {"fw": 9}}))
            .await
            .unwrap();
        (status, made)
    };
    let waiting = server
        .client_for_role("kept-waiting", "operator")
        .await
        .unwrap();
    let (status, made) = make(waiting.clone()).await;
    assert_eq!(status, 201, "{made}");
    let waiting_plan = made["plan_id"].as_str().unwrap().to_owned();

    // One operator makes as many plans as it may keep; the next is
    // refused, and no plan, its own or another's, is forgotten for it.
    let busy = server
        .client_for_role("kept-busy", "operator")
        .await
        .unwrap();
    let mut busy_plans = Vec::new();
    for _ in 0..MAX_PLANS_PER_AUTHOR {
        let (status, made) = make(busy.clone()).await;
        assert_eq!(status, 201, "{made}");
        busy_plans.push(made["plan_id"].as_str().unwrap().to_owned());
    }
    let (status, answer) = make(busy.clone()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("too_many_plans")),
        "{answer}"
    );
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "kept-busy keeps {MAX_PLANS_PER_AUTHOR} plans in use"
        )),
        "the refusal names the bound reached: {message}"
    );
    let status_of =
        |id: String| async move { server.get(&format!("/v1/plans/{id}")).await.unwrap().0 };
    assert_eq!(
        status_of(waiting_plan.clone()).await,
        200,
        "another operator's plan, waiting for approval, is kept"
    );
    for plan in &busy_plans {
        assert_eq!(status_of(plan.clone()).await, 200, "its own plan {plan}");
    }

    // Filled by others, the book refuses a new plan with the reason.
    let kept_now = 1 + MAX_PLANS_PER_AUTHOR;
    let mut others = 0;
    while kept_now + others < MAX_PLANS_KEPT {
        let other = server
            .client_for_role(&format!("kept-other-{others}"), "operator")
            .await
            .unwrap();
        let (status, made) = make(other).await;
        assert_eq!(status, 201, "{made}");
        others += 1;
    }
    let late = server
        .client_for_role("kept-late", "operator")
        .await
        .unwrap();
    let (status, answer) = make(late).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("too_many_plans")),
        "{answer}"
    );
    assert_eq!(status_of(waiting_plan).await, 200);
}
