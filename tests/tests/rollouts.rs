//! Staged rollouts end to end against real PostgreSQL and a private
//! Mosquitto: waves counted over the devices that need a push, a gate that
//! pauses the rollout with a `rollout.paused` event naming it, a resume,
//! an abort that skips the rest, and exact summary counts.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_device_sim::{DeviceBehaviour, FleetPlan};
use idem_tests::{wait_until, Scenario, ServerSettings};
use serde_json::{json, Value};

async fn run(scenario: &Scenario, run_id: &str) -> Value {
    let (status, run) = scenario
        .server
        .get(&format!("/v1/runs/{run_id}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{run}");
    run
}

async fn rollout_events(scenario: &Scenario, run_id: &str) -> Vec<(String, Value)> {
    sqlx::query_as(
        "SELECT type, cloudevent->'data' FROM events \
         WHERE type LIKE 'io.idem.rollout.%' AND subject = $1 ORDER BY sequence",
    )
    .bind(run_id)
    .fetch_all(scenario.db.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_of_the_devices_that_need_the_change_pauses_on_its_gate_resumes_and_aborts() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let mut plan = FleetPlan::new("ro-", 1_000).seed(5).build().unwrap();
    let old = plan.desired_spec.clone();
    let mut new = old.clone();
    new["firmware"] = json!("3.0.0");
    // 900 devices run the new spec already; 100 need it. In id order the
    // waves take 10, then 40, then 50 of those; three of the second wave
    // refuse every push.
    for device in &mut plan.devices[..900] {
        device.spec = new.clone();
    }
    for index in [920, 930, 940] {
        let device = plan.devices[index].clone();
        plan.devices[index] = device.with_behaviour(DeviceBehaviour::Reject {
            message: "no room for 3.0.0".into(),
        });
    }
    let _fleet = scenario.register_and_start(&plan, 1_000).await.unwrap();

    let body = json!({
        "all": true,
        "spec": new,
        "rollout": {"waves": ["10%", "50%", "100%"], "gates": {"max_failures": 2}},
    });
    let (status, started) = scenario.server.post("/v1/desired", &body).await.unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();

    wait_until(Duration::from_secs(30), "the rollout pauses", || async {
        run(&scenario, &run_id).await["rollout"]["state"] == "paused"
    })
    .await
    .unwrap();
    let paused = run(&scenario, &run_id).await;
    assert_eq!(paused["counts"]["already_converged"], 900, "{paused}");
    let waves = &paused["rollout"]["waves"];
    assert_eq!(waves[0]["size"], 10);
    assert_eq!(
        waves[0]["provisioned"], 10,
        "the first wave pushed exactly 10"
    );
    assert_eq!(waves[1]["size"], 40);
    assert_eq!(waves[1]["failed"], 3);
    assert_eq!(waves[2]["state"], "pending");
    assert_eq!(paused["rollout"]["paused"]["gate"], "max_failures");
    let events = rollout_events(&scenario, &run_id).await;
    let (_, data) = events
        .iter()
        .find(|(kind, _)| kind == "io.idem.rollout.paused")
        .expect("a rollout.paused event");
    assert_eq!(data["gate"], "max_failures");
    assert_eq!(data["observed"], 3.0);
    assert_eq!(data["limit"], 2.0);

    // The dashboard's series say so, without a device id.
    let metric = |series: &'static str| {
        let server = &scenario.server;
        async move { server.metric(series).await.unwrap() }
    };
    wait_until(
        Duration::from_secs(10),
        "the gauges show the pause",
        || async { metric("idem_rollouts{state=\"paused_gate\"}").await == 1.0 },
    )
    .await
    .unwrap();
    assert_eq!(metric("idem_rollouts{state=\"running\"}").await, 0.0);
    assert_eq!(
        metric("idem_rollout_wave_devices{progress=\"size\"}").await,
        40.0
    );
    assert_eq!(metric("idem_rollout_devices_waiting").await, 50.0);
    assert_eq!(
        metric("idem_rollout_steps_total{step=\"paused\"}").await,
        1.0
    );
    assert_eq!(
        metric("idem_rollout_steps_total{step=\"wave_completed\"}").await,
        1.0
    );

    // Nothing of the last wave is pushed while paused.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last_wave = plan.devices[950].id.to_string();
    let device = scenario.device(&last_wave).await.unwrap();
    assert_eq!(
        device["reported"]["spec"]["firmware"], old["firmware"],
        "{device}"
    );
    assert_eq!(device["in_sync"], false, "{device}");

    let (status, answer) = scenario
        .server
        .post(&format!("/v1/rollouts/{run_id}/resume"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    // A resumed wave is done: the last wave starts; abort it at once.
    let (status, answer) = scenario
        .server
        .post(&format!("/v1/rollouts/{run_id}/abort"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let done = scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(30))
        .await
        .unwrap();
    let counts = &done["counts"];
    let total = [
        "already_converged",
        "provisioned",
        "failed",
        "skipped",
        "superseded",
    ]
    .iter()
    .map(|k| counts[k].as_u64().unwrap())
    .sum::<u64>();
    assert_eq!(total, 1_000, "{done}");
    assert_eq!(counts["already_converged"], 900);
    assert_eq!(counts["failed"], 3);
    wait_until(
        Duration::from_secs(10),
        "the gauges show no rollout",
        || async {
            metric("idem_rollouts{state=\"running\"}").await
                + metric("idem_rollouts{state=\"paused_gate\"}").await
                == 0.0
        },
    )
    .await
    .unwrap();
    assert_eq!(metric("idem_rollout_devices_waiting").await, 0.0);
    assert_eq!(
        metric("idem_rollout_steps_total{step=\"aborted\"}").await,
        1.0
    );
    assert_eq!(
        metric("idem_rollout_steps_total{step=\"resumed\"}").await,
        1.0
    );
    let skipped = counts["skipped"].as_u64().unwrap();
    let provisioned = counts["provisioned"].as_u64().unwrap();
    assert_eq!(provisioned + skipped, 97, "{done}");
    assert!(
        provisioned >= 47,
        "the first two waves' 47 accepting devices: {done}"
    );
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    let aborted = outcomes
        .values()
        .filter(|row| row["reason"] == "aborted")
        .count() as u64;
    assert_eq!(aborted, skipped, "every skip is an abort");
    assert_eq!(done["rollout"]["state"], "aborted");

    // Acting on an ended rollout, or on a run that is no rollout.
    let (status, refused) = scenario
        .server
        .post(&format!("/v1/rollouts/{run_id}/resume"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (409, json!("rollout_state"))
    );
    let plain = scenario
        .server
        .start_run(&json!({"all": true}))
        .await
        .unwrap();
    let (status, refused) = scenario
        .server
        .post(&format!("/v1/rollouts/{plain}/abort"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (409, json!("not_a_rollout"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waves_that_do_not_end_at_all_devices_are_refused_naming_the_field() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("rb-", 2).build().unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    let cases = [
        (json!({"waves": ["10%", "50%"]}), "rollout.waves[1].size"),
        (
            json!({"waves": ["50%", "10%", "100%"]}),
            "rollout.waves[1].size",
        ),
        (json!({"waves": ["150%"]}), "rollout.waves[0].size"),
        // Nothing follows the last wave for these to hold back.
        (
            json!({"waves": ["10%", {"size": "100%", "approve": true}]}),
            "rollout.waves[1].approve",
        ),
        (
            json!({"waves": ["10%", {"size": "100%", "pause": "manual"}]}),
            "rollout.waves[1].pause",
        ),
        (
            json!({"waves": [{"size": "100%", "pause": "10m"}]}),
            "rollout.waves[0].pause",
        ),
        (
            json!({"waves": ["100%"], "gates": {"min_success_ratio": 1.5}}),
            "rollout.gates.min_success_ratio",
        ),
    ];
    let body = json!({"all": true, "rollout": {"waves": ["100%"]}});
    let (status, answer) = scenario.server.post("/v1/runs", &body).await.unwrap();
    assert_eq!(
        (status, answer["error"]["code"].clone()),
        (400, json!("invalid_rollout"))
    );
    for (rollout, field) in cases {
        let body = json!({"all": true, "spec": {"fw": 2}, "rollout": rollout});
        let (status, answer) = scenario.server.post("/v1/desired", &body).await.unwrap();
        assert_eq!(status, 400, "{rollout}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_rollout");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{message} names {field}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_with_nothing_to_push_completes_at_once_and_waits_for_no_approval() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("rn-", 4).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 4).await.unwrap();
    // The rollout's own pause is for every wave but the last: accepted.
    let rollout = json!({
        "waves": [{"size": "10%", "approve": true}, {"size": "50%", "pause": "manual"}, "100%"],
        "pause": "1h",
    });
    let cases = [
        // A plan over no device at all.
        json!({"selector": {"labels": {"site": "nowhere"}}, "spec": {"a": 1}}),
        // A plan over devices that all run its spec already.
        json!({"all": true, "spec": plan.desired_spec}),
    ];
    for target in cases {
        let (status, made) = scenario.server.post("/v1/plans", &target).await.unwrap();
        assert_eq!(status, 201, "{made}");
        let plan_id = made["plan_id"].as_str().unwrap();
        let (status, started) = scenario
            .server
            .post(
                &format!("/v1/plans/{plan_id}/apply"),
                &json!({"rollout": rollout}),
            )
            .await
            .unwrap();
        assert_eq!(status, 200, "{started}");
        let run_id = started["run_id"].as_str().unwrap().to_owned();
        let done = scenario
            .server
            .wait_run_completed(&run_id, Duration::from_secs(20))
            .await
            .unwrap();
        assert_eq!(
            done["rollout"]["state"], "completed",
            "{target}: a rollout with nothing to push waits for nothing: {done}"
        );
        let (status, answer) = scenario
            .server
            .post(&format!("/v1/rollouts/{run_id}/approve"), &json!({}))
            .await
            .unwrap();
        assert_eq!(status, 409, "nothing is left to approve: {answer}");
    }
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_the_engine_approves_resumes_and_refuses_rollout_actions_as_the_holder_would(
) {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some("rollout-any".to_owned()),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let plan = FleetPlan::new("ra-", 10).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 10).await.unwrap();
    let other = idem_tests::TestServer::start(
        &scenario.db,
        &scenario.broker,
        ServerSettings {
            topic_root: Some(scenario.server.topic_root.to_string()),
            share_group: Some("rollout-any".to_owned()),
            ..ServerSettings::default()
        },
    )
    .await
    .unwrap();
    let (_, ready) = other.get("/readyz").await.unwrap();
    let owns = ready["owns"].as_array().cloned().unwrap_or_default();
    assert!(
        !owns.contains(&json!("engine")),
        "the second instance must not hold the engine: {ready}"
    );
    let alice = scenario
        .server
        .client_for_role("alice", "operator")
        .await
        .unwrap();
    let bob = scenario
        .server
        .client_for_role("bob", "operator")
        .await
        .unwrap();
    let (alice_there, bob_there) = (
        other.with_token(alice.token()),
        other.with_token(bob.token()),
    );
    let mut v2 = plan.desired_spec.clone();
    v2["firmware"] = json!("2.0.0");
    let rollout = json!({"waves": [{"size": "10%", "approve": true}, {"size": "50%", "pause": "manual"}, "100%"]});
    let (status, started) = alice
        .post(
            "/v1/desired",
            &json!({"all": true, "spec": v2, "rollout": rollout}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    let paused_for = |reason: &'static str| {
        let run_id = run_id.clone();
        let scenario = &scenario;
        async move {
            wait_until(
                Duration::from_secs(20),
                &format!("the rollout to pause for {reason}"),
                || async { run(scenario, &run_id).await["rollout"]["paused"]["reason"] == reason },
            )
            .await
            .unwrap();
        }
    };
    paused_for("approval").await;

    // Through the instance without the engine: the author's approval is
    // refused as the holder refuses it, another operator's is carried out.
    let approve = format!("/v1/rollouts/{run_id}/approve");
    let (status, answer) = alice_there.post(&approve, &json!({})).await.unwrap();
    assert_eq!(
        (status, answer["error"]["code"].clone()),
        (403, json!("self_approval")),
        "{answer}"
    );
    let (status, acted) = bob_there.post(&approve, &json!({})).await.unwrap();
    assert_eq!(status, 200, "{acted}");
    assert_eq!(acted["run_id"], run_id.as_str(), "{acted}");
    paused_for("manual").await;
    let (status, acted) = bob_there
        .post(&format!("/v1/rollouts/{run_id}/resume"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{acted}");
    let done = scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done["rollout"]["state"], "completed", "{done}");
    assert_eq!(done["counts"]["provisioned"], 10, "{done}");
    // Once completed, the holder's refusal comes back through the other.
    let (status, answer) = bob_there
        .post(&format!("/v1/rollouts/{run_id}/abort"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, answer["error"]["code"].clone()),
        (409, json!("rollout_state")),
        "{answer}"
    );
    fleet.shutdown().await.unwrap();
}
