//! Approval end to end against real PostgreSQL and a private Mosquitto: a
//! change to devices an approval policy covers (or any change, with
//! `--require-approval`) is refused outside a plan; its author cannot
//! approve that plan; another operator can; the applied run and the audit
//! trail name the approver; a plan is applied in waves; and none of it can
//! be walked around (`walk_arounds`).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_device_sim::FleetPlan;
use idem_tests::{Scenario, ServerSettings};
use serde_json::{json, Value};

mod walk_arounds;

fn code(answer: &Value) -> &str {
    answer["error"]["code"].as_str().unwrap_or("")
}

async fn audit_of(scenario: &Scenario, actor: &str) -> Vec<Value> {
    let (status, audit) = scenario
        .server
        .get(&format!("/v1/audit?actor={actor}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{audit}");
    audit["entries"].as_array().unwrap().clone()
}

/// Every device checked once since it connected, so that no status moves
/// under a plan made next.
async fn settle(scenario: &Scenario) {
    let run_id = scenario
        .server
        .start_run(&json!({"all": true}))
        .await
        .unwrap();
    scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(30))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_a_policy_covers_is_applied_only_through_a_plan_another_operator_approved() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("appr-", 20).seed(3).build().unwrap();
    let _fleet = scenario.register_and_start(&plan, 20).await.unwrap();
    settle(&scenario).await;
    let admin = &scenario.server;
    let critical: Vec<String> = plan.devices[..5].iter().map(|d| d.id.to_string()).collect();
    for id in &critical {
        let (status, answer) = admin
            .put(
                &format!("/v1/devices/{id}"),
                &json!({"labels": {"tier": "critical"}}),
            )
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
    }
    let alice = admin.client_for_role("alice", "operator").await.unwrap();
    let bob = admin.client_for_role("bob", "operator").await.unwrap();

    // Only an admin makes a policy, and it names at least one label.
    let policy_body = json!({"selector": {"labels": {"tier": "critical"}}, "reason": "the line"});
    let (status, answer) = alice
        .post("/v1/approval-policies", &policy_body)
        .await
        .unwrap();
    assert_eq!((status, code(&answer)), (403, "forbidden"), "{answer}");
    let (status, answer) = admin
        .post(
            "/v1/approval-policies",
            &json!({"selector": {"labels": {}}, "reason": "everything"}),
        )
        .await
        .unwrap();
    assert_eq!((status, code(&answer)), (400, "empty_selector"), "{answer}");
    let (status, policy) = admin
        .post("/v1/approval-policies", &policy_body)
        .await
        .unwrap();
    assert_eq!(status, 201, "{policy}");
    assert_eq!(policy["devices"], 5, "{policy}");
    assert!(
        policy["author"].as_str().unwrap().starts_with("test-admin"),
        "{policy}"
    );
    let policy_id = policy["id"].as_str().unwrap().to_owned();

    let mut new = plan.desired_spec.clone();
    new["firmware"] = json!("4.0.0");
    // A direct change touching a covered device is refused, and changes nothing.
    let (status, answer) = alice
        .post("/v1/desired", &json!({"all": true, "spec": new}))
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "approval_required"),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&policy_id),
        "{answer}"
    );
    let (status, answer) = alice
        .put(
            &format!("/v1/devices/{}/desired", critical[0]),
            &json!({"spec": new}),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "approval_required"),
        "{answer}"
    );
    // So is a registration that replaces a covered device's desired spec;
    // its labels are left as they were.
    let (status, answer) = alice
        .post(
            "/v1/devices",
            &json!([{"id": critical[1], "labels": {"tier": "critical", "row": "2"}, "spec": new}]),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "approval_required"),
        "{answer}"
    );
    let device = scenario.device(&critical[1]).await.unwrap();
    assert_eq!(device["labels"], json!({"tier": "critical"}), "{device}");
    assert_eq!(device["desired"]["generation"], 1, "{device}");
    // A device no policy covers changes without approval.
    let free = plan.devices[10].id.to_string();
    let (status, answer) = alice
        .put(
            &format!("/v1/devices/{free}/desired"),
            &json!({"spec": new}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    admin
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(30))
        .await
        .unwrap();

    // Through a plan: it says approval is needed and why.
    let (status, made) = alice
        .post("/v1/plans", &json!({"all": true, "spec": new}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["approval"]["required"], true, "{made}");
    assert!(made["approval"]["reason"]
        .as_str()
        .unwrap()
        .contains("covers 5 of its device(s)"));
    let plan_id = made["plan_id"].as_str().unwrap().to_owned();
    let (status, answer) = alice
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "approval_required"),
        "{answer}"
    );
    let (status, answer) = alice
        .post(&format!("/v1/plans/{plan_id}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!((status, code(&answer)), (403, "self_approval"), "{answer}");
    let (status, approved) = bob
        .post(&format!("/v1/plans/{plan_id}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{approved}");
    assert_eq!(approved["approved_by"], "bob");
    let (status, answer) = admin
        .post(&format!("/v1/plans/{plan_id}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "already_approved"),
        "{answer}"
    );
    let (_, shown) = alice.get(&format!("/v1/plans/{plan_id}")).await.unwrap();
    assert_eq!(shown["approval"]["approved_by"], "bob", "{shown}");

    // Applied by its author, in two waves.
    let (status, started) = alice
        .post(
            &format!("/v1/plans/{plan_id}/apply"),
            &json!({"rollout": {"waves": ["50%", "100%"]}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    let done = admin
        .wait_run_completed(&run_id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done["approval"]["by"], "bob", "{done}");
    assert_eq!(done["plan_id"], plan_id.as_str(), "{done}");
    assert_eq!(done["started_by"], "alice", "{done}");
    assert_eq!(done["counts"]["provisioned"], 19, "{done}");
    assert_eq!(done["counts"]["already_converged"], 1, "{done}");
    let waves = done["rollout"]["waves"].as_array().unwrap();
    assert_eq!(
        waves
            .iter()
            .map(|w| w["size"].as_u64().unwrap())
            .sum::<u64>(),
        19,
        "{done}"
    );

    // The trail has the approval and the apply that names it.
    let bobs = audit_of(&scenario, "bob").await;
    let approval = bobs
        .iter()
        .find(|e| e["route"] == "/v1/plans/{id}/approve" && e["status"] == 200)
        .expect("bob's approval in the audit trail");
    assert_eq!(approval["detail"]["plan_id"], plan_id.as_str());
    assert_eq!(approval["detail"]["plan_author"], "alice");
    let alices = audit_of(&scenario, "alice").await;
    let applied = alices
        .iter()
        .find(|e| e["route"] == "/v1/plans/{id}/apply" && e["status"] == 200)
        .expect("alice's apply in the audit trail");
    assert_eq!(applied["detail"]["approved_by"], "bob");
    assert_eq!(applied["run_id"], run_id.as_str());
    assert!(alices
        .iter()
        .any(|e| e["route"] == "/v1/plans/{id}/approve" && e["status"] == 403));

    // Without the policy, a direct change goes through again.
    let (status, answer) = admin
        .delete(&format!("/v1/approval-policies/{policy_id}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = admin
        .delete(&format!("/v1/approval-policies/{policy_id}"))
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (404, "unknown_approval_policy"),
        "{answer}"
    );
    let (status, list) = admin.get("/v1/approval-policies").await.unwrap();
    assert_eq!((status, &list["policies"]), (200, &json!([])), "{list}");
    new["firmware"] = json!("4.0.1");
    let (status, answer) = alice
        .post("/v1/desired", &json!({"all": true, "spec": new}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_require_approval_every_desired_change_waits_for_a_second_operator() {
    let settings = ServerSettings {
        require_approval: true,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let plan = FleetPlan::new("flag-", 4).seed(4).build().unwrap();
    let _fleet = scenario.register_and_start(&plan, 4).await.unwrap();
    settle(&scenario).await;
    let admin = &scenario.server;
    let carol = admin.client_for_role("carol", "operator").await.unwrap();
    let mut new = plan.desired_spec.clone();
    new["firmware"] = json!("5.0.0");
    let (status, answer) = carol
        .post("/v1/desired", &json!({"all": true, "spec": new}))
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "approval_required"),
        "{answer}"
    );
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--require-approval"));
    let (_, made) = carol
        .post("/v1/plans", &json!({"all": true, "spec": new}))
        .await
        .unwrap();
    let plan_id = made["plan_id"].as_str().unwrap().to_owned();
    let (status, answer) = carol
        .post(&format!("/v1/plans/{plan_id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "approval_required"),
        "{answer}"
    );
    let (status, answer) = admin
        .post(&format!("/v1/plans/{plan_id}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    // An apply without a body at all, as before bodies were taken.
    let response = carol
        .request(reqwest::Method::POST, &format!("/v1/plans/{plan_id}/apply"))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let started: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{started}");
    let done = admin
        .wait_run_completed(started["run_id"].as_str().unwrap(), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done["counts"]["provisioned"], 4, "{done}");
    assert!(done["approval"]["by"]
        .as_str()
        .unwrap()
        .starts_with("test-admin"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relabelling_a_device_out_of_a_policy_is_refused_so_its_approval_cannot_be_walked_around() {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some("walk-around".to_owned()),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let plan = FleetPlan::new("walk-", 3).build().unwrap();
    let _fleet = scenario.register_and_start(&plan, 3).await.unwrap();
    let admin = &scenario.server;
    // A second instance over the same fleet: the rule is the database's.
    let second = idem_tests::TestServer::start(
        &scenario.db,
        &scenario.broker,
        ServerSettings {
            topic_root: Some(scenario.server.topic_root.to_string()),
            share_group: Some("walk-around".to_owned()),
            ..ServerSettings::default()
        },
    )
    .await
    .unwrap();
    let (critical, other) = (
        plan.devices[0].id.to_string(),
        plan.devices[1].id.to_string(),
    );
    let (status, answer) = admin
        .put(
            &format!("/v1/devices/{critical}"),
            &json!({"labels": {"tier": "critical", "site": "a"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let (status, policy) = admin
        .post(
            "/v1/approval-policies",
            &json!({"selector": {"labels": {"tier": "critical"}}, "reason": "the line"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{policy}");
    let policy_id = policy["id"].as_str().unwrap().to_owned();
    let mut changed = plan.desired_spec.clone();
    changed["firmware"] = json!("9.9.9");

    let operator = admin.client_for_role("walker", "operator").await.unwrap();
    for server in [&scenario.server, &second] {
        let alice = server.client_with(operator.token());
        // Relabelled out of the selector, alone or with a new spec in the
        // same call: refused, nothing written.
        let refused = (409, "approval_required", policy_id.as_str());
        alice
            .expect_refused(
                reqwest::Method::PUT,
                &format!("/v1/devices/{critical}"),
                &json!({"labels": {"site": "a"}}),
                refused,
            )
            .await
            .unwrap();
        alice
            .expect_refused(
                reqwest::Method::POST,
                "/v1/devices",
                &json!([{"id": critical, "labels": {"site": "a"}, "spec": changed}]),
                refused,
            )
            .await
            .unwrap();
        // And a desired change made directly, on either instance.
        alice
            .expect_refused(
                reqwest::Method::PUT,
                &format!("/v1/devices/{critical}/desired"),
                &json!({"spec": changed}),
                refused,
            )
            .await
            .unwrap();
        let device = scenario.device(&critical).await.unwrap();
        assert_eq!(device["labels"]["tier"], "critical", "{device}");
        assert_eq!(device["desired"]["generation"], 1, "{device}");
        // Labels that keep it covered are a change like any other.
        let (status, answer) = alice
            .put(
                &format!("/v1/devices/{critical}"),
                &json!({"labels": {"tier": "critical", "site": "b"}}),
            )
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
    }
    // Into a policy's selector: only more protection, not refused.
    let (status, answer) = second
        .put(
            &format!("/v1/devices/{other}"),
            &json!({"labels": {"tier": "critical"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    // Once an admin deleted the policy (audited), the device may leave.
    let (status, _) = admin
        .delete(&format!("/v1/approval-policies/{policy_id}"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let (status, answer) = second
        .put(
            &format!("/v1/devices/{critical}"),
            &json!({"labels": {"site": "a"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
}
