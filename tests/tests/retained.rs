//! End to end: the retained desired message on the broker always equals the
//! current desired state, so a device that reboots never applies a withdrawn
//! generation; a deleted device's retained messages are cleared.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_device_sim::{DeviceBehaviour, OfflineMode, SimDevice};
use idem_protocol::{Channel, Desired, DeviceId, Generation, SpecBudget, TopicRoot};
use idem_tests::{Scenario, ServerSettings};
use serde_json::{json, Value};

async fn set_desired(scenario: &Scenario, id: &str, spec: &Value) -> Value {
    let (status, answer) = scenario
        .server
        .put(&format!("/v1/devices/{id}/desired"), &json!({"spec": spec}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    scenario
        .server
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap()
}

fn topic(root: &TopicRoot, id: &DeviceId, channel: Channel) -> String {
    root.topic(id, channel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebooting_device_never_applies_a_withdrawn_generation() {
    // One attempt per device: the refusal quarantines it at once.
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let id = DeviceId::parse("reboot-1").unwrap();
    let v1 = json!({"fw": "1.0"});
    let v2 = json!({"fw": "2.0"});
    // Refuses the first push that needs work, accepts later ones.
    let device = SimDevice::new(id.clone(), v1.clone())
        .with_generation(Some(1))
        .with_behaviour(DeviceBehaviour::RejectTimes {
            times: 1,
            message: "flash full".into(),
        });
    scenario
        .register(std::slice::from_ref(&device), &v1)
        .await
        .unwrap();
    let fleet = scenario.start_fleet(vec![device]).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(10))
        .await
        .unwrap();

    // Generation 2 is refused: failed, quarantined; the broker retains it.
    let run = set_desired(&scenario, id.as_str(), &v2).await;
    assert_eq!(run["counts"]["failed"], 1, "{run}");
    // The operator withdraws it: generation 3 is what the device runs.
    let run = set_desired(&scenario, id.as_str(), &v1).await;
    assert_eq!(run["counts"]["failed"], 0, "{run}");

    // The retained message is generation 3 now, not the withdrawn 2.
    let desired_topic = topic(&scenario.server.topic_root, &id, Channel::Desired);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let retained = scenario.broker.retained_on(&desired_topic).await.unwrap();
        let retained = Desired::decode(&retained, SpecBudget::default()).unwrap();
        if retained.generation == Generation(3) {
            assert_eq!(retained.spec, v1);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the broker still retains generation {}",
            retained.generation
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The device reboots: it receives generation 3 and installs nothing.
    fleet.take_offline(&id, OfflineMode::Abrupt).unwrap();
    fleet.bring_online(&id).unwrap();
    fleet
        .wait_connected(1, Duration::from_secs(10))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while fleet.state(&id).unwrap().generation != Some(3) {
        assert!(Instant::now() < deadline, "{:?}", fleet.state(&id));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = fleet.state(&id).unwrap();
    assert_eq!(state.spec, v1);
    assert!(
        !state.installed.contains(&2),
        "the device installed the withdrawn generation 2: {:?}",
        state.installed
    );
    assert!(
        scenario
            .server
            .metric("idem_retained_updates_total")
            .await
            .unwrap()
            >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_never_pushed_to_gets_no_retained_message_for_a_change_it_already_runs() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let id = DeviceId::parse("quiet-1").unwrap();
    let v1 = json!({"fw": "1.0"});
    let device = SimDevice::new(id.clone(), v1.clone());
    scenario
        .register(std::slice::from_ref(&device), &json!({"fw": "0.9"}))
        .await
        .unwrap();
    let fleet = scenario.start_fleet(vec![device]).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(10))
        .await
        .unwrap();

    let run = set_desired(&scenario, id.as_str(), &v1).await;
    assert_eq!(
        run["summary"],
        "1 already converged, 0 provisioned, 0 failed"
    );
    let desired_topic = topic(&scenario.server.topic_root, &id, Channel::Desired);
    assert_eq!(scenario.broker.retained_on(&desired_topic).await, None);
    assert_eq!(fleet.state(&id).unwrap().desired_received, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_device_clears_its_retained_messages_and_ends_its_attempt_skipped() {
    let scenario = Scenario::start(ServerSettings {
        push_timeout: Duration::from_secs(60),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let root = scenario.server.topic_root.clone();
    let pushed = DeviceId::parse("gone-1").unwrap();
    let hung = DeviceId::parse("gone-2").unwrap();
    let v1 = json!({"fw": "1.0"});
    let devices = vec![
        SimDevice::new(pushed.clone(), json!({"fw": "0.1"})),
        SimDevice::new(hung.clone(), json!({"fw": "0.1"}))
            .with_behaviour(DeviceBehaviour::IgnorePushes),
    ];
    scenario.register(&devices, &v1).await.unwrap();
    let _fleet = scenario.start_fleet(devices).await.unwrap();
    scenario
        .wait_reports_stored(2, Duration::from_secs(10))
        .await
        .unwrap();
    let run_id = scenario
        .server
        .start_run(&json!({"all": true}))
        .await
        .unwrap();
    // gone-1 confirms; gone-2 ignores the push and holds the run open.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, device) = scenario.server.get("/v1/devices/gone-1").await.unwrap();
        if device["status"] == "converged" {
            break;
        }
        assert!(Instant::now() < deadline, "{device}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let desired_topic = topic(&root, &pushed, Channel::Desired);
    assert!(scenario.broker.retained_on(&desired_topic).await.is_some());

    for id in [&pushed, &hung] {
        let (status, body) = scenario
            .server
            .delete(&format!("/v1/devices/{id}"))
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let run = scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        run["summary"], "0 already converged, 1 provisioned, 0 failed, 1 skipped",
        "{run}"
    );
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    assert_eq!(outcomes["gone-2"]["reason"], "device deleted");
    for id in [&pushed, &hung] {
        for channel in [Channel::Desired, Channel::Status] {
            let t = topic(&root, id, channel);
            let cleared = scenario
                .broker
                .wait_nothing_retained_on(&t, Duration::from_secs(5))
                .await;
            assert_eq!(cleared, Ok(()), "{t}");
        }
        let (status, _) = scenario
            .server
            .get(&format!("/v1/devices/{id}"))
            .await
            .unwrap();
        assert_eq!(status, 404);
    }
    let (status, ready) = scenario.server.get("/readyz").await.unwrap();
    assert_eq!(status, 200, "{ready}");
}
