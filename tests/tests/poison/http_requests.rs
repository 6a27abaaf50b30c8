//! Poison sent to the HTTP API (specs over the budget, NUL in specs, labels
//! and query text, oversized labels, identical runs) and clients that hold
//! connections and event streams without reading.

use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use idem_tests::{Scenario, ServerSettings};
use serde_json::{json, Value};

use crate::{assert_the_fleet_is_still_served, converged_fleet, metric};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_over_the_budget_is_refused_by_every_endpoint_with_the_limit_named() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "big-", 5).await;
    let server = &scenario.server;
    let huge = json!({"blob": "x".repeat(1_900_000)});

    let (status, body) = server
        .put(
            "/v1/devices/big-00000/desired",
            &json!({"spec": huge, "force": true}),
        )
        .await
        .unwrap();
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "spec_too_large");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("the limit is 65536 bytes"), "{message}");
    assert!(message.contains("IDEM_MAX_SPEC_BYTES"), "{message}");

    let just_over = json!({"blob": "x".repeat(65_536)});
    let (status, body) = server
        .post("/v1/desired", &json!({"all": true, "spec": just_over}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("spec_too_large")),
        "{body}"
    );
    let (status, body) = server
        .post(
            "/v1/devices",
            &json!([{"id": "big-new", "spec": just_over}]),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("spec_too_large")),
        "{body}"
    );

    assert_eq!(metric(server, "idem_mqtt_reconnects_total").await, 0.0);
    assert_eq!(metric(server, "idem_pushes_total").await, 0.0);
    assert_the_fleet_is_still_served(server, scenario.db.pool(), &fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_at_a_raised_budget_is_pushed_and_its_faithful_confirmation_accepted() {
    let settings = ServerSettings {
        max_spec_bytes: 128 * 1024,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "wide-", 3).await;
    let spec = json!({"blob": "y".repeat(70_000)});

    let (status, answer) = scenario
        .server
        .put("/v1/devices/wide-00001/desired", &json!({"spec": spec}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let run = scenario
        .server
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"], "0 already converged, 1 provisioned, 0 failed",
        "{run}"
    );
    let stored: Option<i32> = sqlx::query_scalar(
        "SELECT length(reported_spec->>'blob') FROM devices WHERE id = 'wide-00001'",
    )
    .fetch_one(scenario.db.pool())
    .await
    .unwrap();
    assert_eq!(stored, Some(70_000));
    assert_eq!(
        metric(
            &scenario.server,
            "idem_reports_rejected_total{reason=\"oversized\"}"
        )
        .await,
        0.0
    );
    drop(fleet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_in_specs_labels_reasons_expiries_and_query_text_gets_a_clear_error_without_database_text(
) {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "api-nul-", 3).await;
    let server = &scenario.server;
    let cases = [
        (
            server
                .put(
                    "/v1/devices/api-nul-00000/desired",
                    &json!({"spec": {"x": "a\u{0}"}}),
                )
                .await
                .unwrap(),
            "invalid_spec",
        ),
        (
            server
                .put(
                    "/v1/devices/api-nul-00000",
                    &json!({"labels": {"k": "v\u{0}"}}),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server
                .post(
                    "/v1/devices",
                    &json!([{"id": "api-nul-new", "labels": {"k\u{0}": "v"}}]),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server
                .post(
                    "/v1/desired",
                    &json!({"selector": {"labels": {"k": "\u{0}"}}, "spec": {}}),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server
                .post(
                    "/v1/exemptions",
                    &json!({"device": "api-nul-00000", "reason": "a\u{0}b", "expires_in": "1h"}),
                )
                .await
                .unwrap(),
            "invalid_reason",
        ),
        (
            server
                .post(
                    "/v1/exemptions",
                    &json!({"device": "api-nul-00000", "reason": "ok", "expires_in": "1h\u{0}"}),
                )
                .await
                .unwrap(),
            "invalid_expiry",
        ),
        (
            server
                .post(
                    "/v1/exemptions",
                    &json!({"selector": {"labels": {"k\u{0}": "v"}}, "reason": "ok", "expires_in": "1h"}),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server
                .post(
                    "/v1/approval-policies",
                    &json!({"selector": {"labels": {"tier": "critical"}}, "reason": "\u{0}"}),
                )
                .await
                .unwrap(),
            "invalid_reason",
        ),
        (
            server
                .post(
                    "/v1/approval-policies",
                    &json!({"selector": {"labels": {"tier": "\u{0}"}}, "reason": "ok"}),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server.get("/v1/devices?after=a%00b").await.unwrap(),
            "invalid_query",
        ),
        (
            server.get("/v1/devices?label=k:%00").await.unwrap(),
            "invalid_labels",
        ),
    ];
    for ((status, body), code) in cases {
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (400, Some(code)),
            "{body}"
        );
        let message = body["error"]["message"].as_str().unwrap().to_lowercase();
        for leak in ["sql", "postgres", "0x00", "invalid byte sequence"] {
            assert!(!message.contains(leak), "{message}");
        }
    }
    assert_the_fleet_is_still_served(server, scenario.db.pool(), &fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_are_capped_and_device_pages_stop_at_their_byte_bound() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let big_labels = json!({"k": "v".repeat(1_500_000)});
    let (status, body) = server
        .post(
            "/v1/devices",
            &json!([{"id": "label-1", "labels": big_labels}]),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_labels")),
        "{body}"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains("256"),
        "{body}"
    );

    // 100 devices with specs at the budget: ~6.4 MB of desired specs.
    let spec = json!({"blob": "z".repeat(64_000)});
    for chunk in 0..5 {
        let body: Vec<Value> = (chunk * 20..chunk * 20 + 20)
            .map(|i| json!({"id": format!("page-{i:03}"), "spec": spec}))
            .collect();
        let (status, answer) = server
            .post("/v1/devices", &Value::Array(body))
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
    }
    let mut after: Option<String> = None;
    let mut seen = 0;
    let mut pages = 0;
    loop {
        let path = match &after {
            Some(a) => format!("/v1/devices?limit=1000&after={a}"),
            None => "/v1/devices?limit=1000".to_owned(),
        };
        let (status, page) = server.get(&path).await.unwrap();
        assert_eq!(status, 200, "{page}");
        let size = page.to_string().len();
        assert!(size < 4 * 1024 * 1024 + 200_000, "a page of {size} bytes");
        seen += page["devices"].as_array().unwrap().len();
        pages += 1;
        match page["next_after"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, 100);
    assert!(pages >= 2, "the byte bound must have split the list");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_manual_runs_while_one_is_in_progress_join_it() {
    let scenario = Scenario::start(ServerSettings {
        push_timeout: Duration::from_secs(3),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    // One silent device keeps every run open until its timeout.
    let plan = FleetPlan::new("join-", 50).silent(1).build().unwrap();
    let _fleet = scenario.register_and_start(&plan, 49).await.unwrap();
    let server = &scenario.server;

    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let (status, answer) = server
            .post("/v1/runs", &json!({"all": true}))
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
        ids.insert(answer["run_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "20 identical calls made {} runs", ids.len());
    let (_, forced) = server
        .post("/v1/runs", &json!({"all": true, "force": true}))
        .await
        .unwrap();
    assert_eq!(
        forced["joined"], false,
        "a forced run is another run: {forced}"
    );
    let targets: i64 = sqlx::query_scalar("SELECT count(*) FROM run_outcomes")
        .fetch_one(scenario.db.pool())
        .await
        .unwrap();
    assert_eq!(targets, 100, "two runs of 50 targets");
    let run_id = ids.into_iter().next().unwrap();
    let run = server
        .wait_run_completed(&run_id, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(run["counts"]["failed"], 1, "{run}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_and_greedy_event_streams_do_not_stop_the_fleet() {
    idem_tests::raise_fd_limit().unwrap();
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "greedy-", 20).await;
    // A log worth replaying: 20,000 events of about 1 KB.
    scenario.append_events(20_000, 1_000).await.unwrap();
    // 1,100 connections that never send a request ...
    let mut idle = Vec::with_capacity(1_100);
    for _ in 0..1_100 {
        idle.push(
            tokio::net::TcpStream::connect(scenario.server.addr)
                .await
                .unwrap(),
        );
    }
    // ... and 20 event streams replaying everything, none of them reading.
    let mut streams = Vec::new();
    for _ in 0..20 {
        streams.push(
            idem_tests::StalledSseClient::open(
                scenario.server.addr,
                "/v1/events?after=0",
                scenario.server.token(),
            )
            .await
            .unwrap(),
        );
    }
    let started = Instant::now();
    let (status, _) = scenario.server.get("/healthz").await.unwrap();
    assert_eq!(status, 200);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_the_fleet_is_still_served(&scenario.server, scenario.db.pool(), &fleet).await;
    drop(streams);
    drop(idle);
}
