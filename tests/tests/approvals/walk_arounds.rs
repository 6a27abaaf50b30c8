//! The ways around an approval policy, each closed, through one instance
//! and through another over the same database: an exemption over covered
//! devices waits for a second operator (and one nobody approved never
//! exempts a covered device), a declaration of owned fields that changes
//! what covered devices own is a proposal until approved (and labels that
//! would move a covered device's owned fields are refused), and a covered
//! device deleted and registered again is still covered.

use std::time::Duration;

use idem_tests::deadline::wait_until;
use idem_tests::{ApiClient, Scenario, ServerSettings, TestServer};
use serde_json::{json, Value};

use super::code;

/// A scenario of two instances over one database and broker, with
/// `settings` for both.
async fn two_instances(group: &str, settings: ServerSettings) -> (Scenario, TestServer) {
    let shared = ServerSettings {
        share_group: Some(group.to_owned()),
        ..settings.clone()
    };
    let scenario = Scenario::start(shared).await.unwrap();
    let second = TestServer::start(
        &scenario.db,
        &scenario.broker,
        ServerSettings {
            topic_root: Some(scenario.server.topic_root.to_string()),
            share_group: Some(group.to_owned()),
            ..settings
        },
    )
    .await
    .unwrap();
    (scenario, second)
}

/// Registers `ids` with `labels` and a desired spec.
async fn register(admin: &ApiClient, ids: &[(&str, Value)]) {
    let body: Vec<Value> = ids
        .iter()
        .map(|(id, labels)| json!({"id": id, "labels": labels, "spec": {"firmware": "1.0.0"}}))
        .collect();
    let (status, answer) = admin.post("/v1/devices", &body).await.unwrap();
    assert_eq!(status, 200, "{answer}");
}

async fn policy_over_critical(admin: &ApiClient) -> String {
    let (status, policy) = admin
        .post(
            "/v1/approval-policies",
            &json!({"selector": {"labels": {"tier": "critical"}}, "reason": "the line"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{policy}");
    policy["id"].as_str().unwrap().to_owned()
}

/// Waits until `server` shows device `id` exempt (or not).
async fn wait_exempt(server: &ApiClient, id: &str, exempt: bool) {
    wait_until(
        Duration::from_secs(10),
        &format!("device {id} to read exempt: {exempt}"),
        || async {
            let (status, device) = server.get(&format!("/v1/devices/{id}")).await.unwrap();
            status == 200 && device["exempt"] == exempt
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exemption_over_a_covered_device_exempts_it_only_once_another_operator_approved_it() {
    let (scenario, second) = two_instances("exempt-approval", ServerSettings::default()).await;
    let admin = &scenario.server;
    register(
        admin,
        &[
            ("ex-critical", json!({"tier": "critical"})),
            ("ex-plain", json!({"site": "a"})),
        ],
    )
    .await;
    let policy = policy_over_critical(admin).await;
    let alice = admin.client_for_role("alice", "operator").await.unwrap();
    let bob = admin.client_for_role("bob", "operator").await.unwrap();
    let bob_on_second = second.with_token(bob.token());

    // Asked for through one instance: made, but waiting, and exempting none.
    let (status, made) = alice
        .post(
            "/v1/exemptions",
            &json!({"device": "ex-critical", "reason": "repair", "expires_in": "1h"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["approval"]["required"], true, "{made}");
    assert!(
        made["approval"]["reason"]
            .as_str()
            .unwrap()
            .contains(&policy),
        "{made}"
    );
    assert_eq!(made["approval"]["approved_by"], Value::Null, "{made}");
    let id = made["id"].as_str().unwrap().to_owned();
    for server in [&**admin, &*second] {
        let (_, device) = server.get("/v1/devices/ex-critical").await.unwrap();
        assert_eq!(device["exempt"], false, "{device}");
    }
    // Its author cannot approve it; another operator, through the other
    // instance, can; then both instances hold the device exempt.
    let approve = format!("/v1/exemptions/{id}/approve");
    let (status, answer) = alice.post(&approve, &json!({})).await.unwrap();
    assert_eq!((status, code(&answer)), (403, "self_approval"), "{answer}");
    let (status, approved) = bob_on_second.post(&approve, &json!({})).await.unwrap();
    assert_eq!(status, 200, "{approved}");
    assert!(
        approved["approval"]["approved_by"]
            .as_str()
            .unwrap()
            .starts_with("bob"),
        "{approved}"
    );
    let (status, answer) = bob.post(&approve, &json!({})).await.unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "already_approved"),
        "{answer}"
    );
    wait_exempt(admin, "ex-critical", true).await;
    wait_exempt(&second, "ex-critical", true).await;

    // A selector exemption that covers no covered device needs no approval
    // and exempts at once, but not a covered device that comes under its
    // selector later.
    let (status, made) = alice
        .post(
            "/v1/exemptions",
            &json!({"selector": {"labels": {"site": "a"}}, "reason": "site a", "expires_in": "1h"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["approval"]["required"], false, "{made}");
    wait_exempt(&second, "ex-plain", true).await;
    register(admin, &[("ex-late", json!({"tier": "critical"}))]).await;
    let (status, answer) = second
        .with_token(alice.token())
        .put(
            "/v1/devices/ex-late",
            &json!({"labels": {"tier": "critical", "site": "a"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    for server in [&**admin, &*second] {
        let (_, device) = server.get("/v1/devices/ex-late").await.unwrap();
        assert_eq!(device["exempt"], false, "{device}");
    }
    // Approved, it exempts that device too.
    let site_id = made["id"].as_str().unwrap();
    let (status, answer) = bob
        .post(&format!("/v1/exemptions/{site_id}/approve"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    wait_exempt(&second, "ex-late", true).await;

    // A device that comes under a new policy loses the exemptions nobody
    // approved.
    let (status, _) = admin
        .post(
            "/v1/approval-policies",
            &json!({"selector": {"labels": {"site": "a"}}, "reason": "site a is critical too"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201);
    let (status, made) = alice
        .post(
            "/v1/exemptions",
            &json!({"device": "ex-plain", "reason": "again", "expires_in": "1h"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["approval"]["required"], true, "{made}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_fields_that_change_what_a_covered_device_owns_wait_for_another_operator() {
    let (scenario, second) = two_instances("owned-approval", ServerSettings::default()).await;
    let admin = &scenario.server;
    register(
        admin,
        &[
            ("own-critical", json!({"tier": "critical"})),
            ("own-plain", json!({"site": "a"})),
        ],
    )
    .await;
    let policy = policy_over_critical(admin).await;
    let alice = admin.client_for_role("alice", "operator").await.unwrap();
    let bob = admin.client_for_role("bob", "operator").await.unwrap();

    // Owning `firmware` on the critical device would stop its pushes: a
    // proposal, not in force, on either instance.
    let covered = json!({"by_selector": [{"selector": {"labels": {"tier": "critical"}}, "fields": ["firmware"]}]});
    let (status, proposal) = alice.put("/v1/owned-fields", &covered).await.unwrap();
    assert_eq!(status, 202, "{proposal}");
    assert!(
        proposal["reason"].as_str().unwrap().contains(&policy),
        "{proposal}"
    );
    assert_eq!(proposal["devices_changed"], 1, "{proposal}");
    let proposal_id = proposal["id"].as_str().unwrap().to_owned();
    for server in [&**admin, &*second] {
        let (_, view) = server.get("/v1/owned-fields").await.unwrap();
        assert_eq!(view["by_selector"], json!([]), "{view}");
        assert_eq!(view["devices"], 0, "{view}");
        assert_eq!(view["proposals"][0]["id"], proposal_id.as_str(), "{view}");
    }
    let approve = format!("/v1/owned-fields/proposals/{proposal_id}/approve");
    let (status, answer) = alice.post(&approve, &json!({})).await.unwrap();
    assert_eq!((status, code(&answer)), (403, "self_approval"), "{answer}");
    let (status, view) = second
        .with_token(bob.token())
        .post(&approve, &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["by_selector"], covered["by_selector"], "{view}");
    assert_eq!(view["proposals"], json!([]), "{view}");
    wait_until(
        Duration::from_secs(10),
        "the first instance to hold the approved declaration",
        || async {
            let (_, view) = admin.get("/v1/owned-fields").await.unwrap();
            view["devices"] == 1
        },
    )
    .await
    .unwrap();

    // One that changes no covered device's paths needs no approval.
    let mut wider = covered.clone();
    wider["by_selector"]
        .as_array_mut()
        .unwrap()
        .push(json!({"selector": {"labels": {"site": "b"}}, "fields": ["wifi"]}));
    let (status, view) = alice.put("/v1/owned-fields", &wider).await.unwrap();
    assert_eq!(status, 200, "{view}");

    // Labels that would move what the critical device owns are refused, on
    // either instance; the same labels on a device no policy covers are not.
    for server in [&**admin, &*second] {
        server
            .with_token(alice.token())
            .expect_refused(
                reqwest::Method::PUT,
                "/v1/devices/own-critical",
                &json!({"labels": {"tier": "critical", "site": "b"}}),
                (409, "approval_required", policy.as_str()),
            )
            .await
            .unwrap();
    }
    let (status, answer) = second
        .with_token(alice.token())
        .put("/v1/devices/own-plain", &json!({"labels": {"site": "b"}}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");

    // A proposal overtaken by a later declaration cannot be approved: it
    // would undo that one.
    let (status, stale) = alice.put("/v1/owned-fields", &json!({})).await.unwrap();
    assert_eq!(status, 202, "{stale}");
    let (status, _) = bob
        .put(
            "/v1/owned-fields",
            &json!({"by_selector": wider["by_selector"], "fields": []}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);
    let stale_id = stale["id"].as_str().unwrap();
    let (status, answer) = bob
        .post(
            &format!("/v1/owned-fields/proposals/{stale_id}/approve"),
            &json!({}),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, code(&answer)),
        (409, "owned_fields_changed"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_covered_device_deleted_and_registered_again_is_still_covered() {
    let (scenario, second) = two_instances("departed", ServerSettings::default()).await;
    let admin = &scenario.server;
    register(admin, &[("gone-critical", json!({"tier": "critical"}))]).await;
    let policy = policy_over_critical(admin).await;
    let alice = admin.client_for_role("alice", "operator").await.unwrap();
    let (status, answer) = admin.delete("/v1/devices/gone-critical").await.unwrap();
    assert_eq!(status, 200, "{answer}");
    let refused = (409, "approval_required", policy.as_str());
    let new_spec = json!({"firmware": "6.6.6"});
    for server in [&**admin, &*second] {
        let alice = server.with_token(alice.token());
        // With a new spec, under other labels: its first spec since is a
        // change the policy still covers.
        alice
            .expect_refused(
                reqwest::Method::POST,
                "/v1/devices",
                &json!([{"id": "gone-critical", "labels": {"tier": "spare"}, "spec": new_spec}]),
                refused,
            )
            .await
            .unwrap();
    }
    // Registered without a spec it may be; its desired state then goes
    // through a plan like any covered device's.
    let (status, answer) = second
        .with_token(alice.token())
        .post(
            "/v1/devices",
            &json!([{"id": "gone-critical", "labels": {"tier": "spare"}}]),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    wait_until(
        Duration::from_secs(10),
        "the first instance to hold the device registered through the second",
        || async { admin.get("/v1/devices/gone-critical").await.unwrap().0 == 200 },
    )
    .await
    .unwrap();
    for server in [&**admin, &*second] {
        server
            .with_token(alice.token())
            .expect_refused(
                reqwest::Method::PUT,
                "/v1/devices/gone-critical/desired",
                &json!({"spec": new_spec}),
                refused,
            )
            .await
            .unwrap();
        let (_, policies) = server.get("/v1/approval-policies").await.unwrap();
        assert_eq!(policies["policies"][0]["devices"], 1, "{policies}");
    }
    // Once an admin deleted the policy, nothing covers it.
    let (status, _) = admin
        .delete(&format!("/v1/approval-policies/{policy}"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let (status, answer) = second
        .with_token(alice.token())
        .put(
            "/v1/devices/gone-critical/desired",
            &json!({"spec": new_spec}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_require_approval_exemptions_owned_fields_and_deleted_devices_wait_for_a_second_operator(
) {
    let settings = ServerSettings {
        require_approval: true,
        ..ServerSettings::default()
    };
    let (scenario, second) = two_instances("every-change", settings).await;
    let admin = &scenario.server;
    register(admin, &[("flag-a", json!({})), ("flag-b", json!({}))]).await;
    let alice = admin.client_for_role("alice", "operator").await.unwrap();
    let flag = (409, "approval_required", "--require-approval");
    for server in [&**admin, &*second] {
        let alice = server.with_token(alice.token());
        let (status, made) = alice
            .post(
                "/v1/exemptions",
                &json!({"selector": {"labels": {"none": "yet"}}, "reason": "r", "expires_in": "1h"}),
            )
            .await
            .unwrap();
        assert_eq!(status, 201, "{made}");
        assert_eq!(made["approval"]["required"], true, "{made}");
        let (status, proposal) = alice
            .put("/v1/owned-fields", &json!({"fields": ["uptime"]}))
            .await
            .unwrap();
        assert_eq!(status, 202, "{proposal}");
        assert!(
            proposal["reason"]
                .as_str()
                .unwrap()
                .contains("--require-approval"),
            "{proposal}"
        );
    }
    let (status, _) = admin.delete("/v1/devices/flag-a").await.unwrap();
    assert_eq!(status, 200);
    second
        .with_token(alice.token())
        .expect_refused(
            reqwest::Method::POST,
            "/v1/devices",
            &json!([{"id": "flag-a", "spec": {"firmware": "2.0.0"}}]),
            flag,
        )
        .await
        .unwrap();
    // A device never registered before gets its first spec unasked.
    let (status, answer) = second
        .with_token(alice.token())
        .post(
            "/v1/devices",
            &json!([{"id": "flag-new", "spec": {"firmware": "2.0.0"}}]),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
}
