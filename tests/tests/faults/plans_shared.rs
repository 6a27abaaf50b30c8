//! Two instances on one broker and one database: a plan made on one is
//! read and approved through the other, kept across a restart of both, and
//! applied through the first in waves; the paused rollout resumes through
//! the instance without the engine, and the applied plan is applied on
//! neither again.

use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use idem_tests::{ApiClient, ProcessServer};
use serde_json::{json, Value};

use crate::{owns, private_services, register, start_fleet, start_servers, SERIAL};

const DEVICES: usize = 20;

async fn run_of(client: &ApiClient, run_id: &str) -> Value {
    let (status, run) = client.get(&format!("/v1/runs/{run_id}")).await.unwrap();
    assert_eq!(status, 200, "{run}");
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_made_on_one_instance_is_approved_on_another_kept_across_restarts_and_applied_once()
{
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-plans").await;
    let group = format!("plans{tag}");
    let env = [
        ("IDEM_SHARE_GROUP", group.as_str()),
        ("IDEM_INSTANCE_LEASE", "3s"),
    ];
    let mut servers = start_servers(&["a", "b"], (&broker, &db, &tag, &root), &env).await;
    let fleet_plan = FleetPlan::new("shared-plan-", DEVICES)
        .seed(46)
        .build()
        .unwrap();
    register(&servers[0], &fleet_plan).await;
    let _fleet = start_fleet(&broker, &root, fleet_plan.devices.clone(), None).await;
    crate::wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;
    // The engine writes each device `converged` after its first report: a
    // plan made before that would be stale by the time it is applied.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let converged: i64 =
            sqlx::query_scalar("SELECT count(*) FROM devices WHERE status = 'converged'")
                .fetch_one(db.pool())
                .await
                .unwrap();
        if converged == DEVICES as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{converged} of {DEVICES} devices converged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let alice = idem_tests::server::create_token(db.pool(), "alice", "operator")
        .await
        .unwrap();
    let bob = idem_tests::server::create_token(db.pool(), "bob", "operator")
        .await
        .unwrap();
    let as_on = |who: &str, server: &ProcessServer| server.api().with_token(Some(who));

    let mut v2 = fleet_plan.desired_spec.clone();
    v2["firmware"] = json!("shared-v2");
    let (status, made) = as_on(&alice, &servers[0])
        .post("/v1/plans", &json!({"all": true, "spec": v2}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["counts"]["push"], DEVICES, "{made}");
    let plan_id = made["plan_id"].as_str().unwrap().to_owned();
    let plan_path = format!("/v1/plans/{plan_id}");

    // Every instance restarted (a deploy) between the plan and its apply.
    for server in &mut servers {
        server.stop().unwrap();
    }
    for server in &mut servers {
        server.restart().await.unwrap();
    }

    // Read and approved through the other instance, by another operator.
    let (status, shown) = as_on(&bob, &servers[1]).get(&plan_path).await.unwrap();
    assert_eq!(
        status, 200,
        "the plan, on the other instance after restarts: {shown}"
    );
    assert_eq!(
        (&shown["state"], &shown["author"], &shown["counts"]["push"]),
        (&json!("open"), &json!("alice"), &json!(DEVICES)),
        "{shown}"
    );
    let (status, pushes) = as_on(&bob, &servers[1])
        .get(&format!("{plan_path}/devices?change=push&limit=100"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{pushes}");
    assert_eq!(pushes["devices"].as_array().map(Vec::len), Some(DEVICES));
    let (status, refused) = as_on(&alice, &servers[1])
        .post(&format!("{plan_path}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (403, Some("self_approval")),
        "{refused}"
    );
    let (status, approved) = as_on(&bob, &servers[1])
        .post(&format!("{plan_path}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{approved}");
    let (_, shown) = as_on(&alice, &servers[0]).get(&plan_path).await.unwrap();
    assert_eq!(
        shown["approval"]["approved_by"], "bob",
        "the approval, seen on the first instance: {shown}"
    );

    // Applied through the first, in waves; paused after the first wave.
    let rollout = json!({"waves": [{"size": "50%", "pause": "manual"}, "100%"]});
    let (status, started) = as_on(&alice, &servers[0])
        .post(&format!("{plan_path}/apply"), &json!({"rollout": rollout}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    let (status, again) = as_on(&alice, &servers[1])
        .post(&format!("{plan_path}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, again["error"]["code"].as_str()),
        (409, Some("plan_stale")),
        "a plan applies once, whichever instance is asked: {again}"
    );

    let deadline = Instant::now() + Duration::from_secs(30);
    while run_of(&servers[0].api(), &run_id).await["rollout"]["paused"]["reason"] != "manual" {
        assert!(Instant::now() < deadline, "the rollout did not pause");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let without_engine = if owns(&servers[0], "engine").await {
        1
    } else {
        0
    };
    assert!(
        !owns(&servers[without_engine], "engine").await,
        "one instance holds the engine"
    );
    let (status, resumed) = as_on(&bob, &servers[without_engine])
        .post(&format!("/v1/rollouts/{run_id}/resume"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        status, 200,
        "resumed through the instance without the engine: {resumed}"
    );

    let run = servers[without_engine]
        .wait_run_completed(&run_id, Duration::from_secs(60))
        .await
        .unwrap();
    let counts = &run["counts"];
    assert_eq!(
        (
            &counts["provisioned"],
            &counts["already_converged"],
            &counts["failed"]
        ),
        (&json!(DEVICES), &json!(0), &json!(0)),
        "{run}"
    );
    assert_eq!(run["approval"]["by"], "bob", "{run}");
    let (_, shown) = servers[1].get(&plan_path).await.unwrap();
    assert_eq!(
        (&shown["state"], &shown["applied_run"]),
        (&json!("applied"), &json!(run_id)),
        "{shown}"
    );
}
