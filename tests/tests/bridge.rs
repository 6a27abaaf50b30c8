//! End to end through edge brokers: the server on a core Mosquitto, devices
//! on edge Mosquittos bridged to it (docs/ARCHITECTURE.md, "Edge brokers").
//! Runs decide every device exactly as on one broker; the retained desired
//! message, QoS 1 and device wills cross the bridges as PROTOCOL.md needs.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::time::{Duration, Instant};

use idem_device_sim::{
    check_outcomes, ClientAuth, FleetConfig, FleetPlan, OfflineMode, SecretString, ServerClient,
    SimDevice,
};
use idem_protocol::{Channel, Desired, DeviceId, Generation, SpecBudget};
use idem_tests::{BridgeToCore, PrivateMosquitto, Scenario, ServerSettings};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::json;

/// An edge broker bridged to the scenario's (core) broker; `devices`
/// narrows what the core sends it to those devices' topics.
fn edge(scenario: &Scenario, name: &str, devices: Option<&[SimDevice]>) -> PrivateMosquitto {
    PrivateMosquitto::builder()
        .bridge_to(BridgeToCore {
            core_port: scenario.broker.port(),
            topic_root: scenario.server.topic_root.as_str().to_owned(),
            name: format!("{name}-{}", uuid::Uuid::new_v4().simple()),
            devices: devices.map(|d| d.iter().map(|d| d.id.to_string()).collect()),
        })
        .start()
        .unwrap()
}

/// A fleet of `devices` on `edge` under the server's topic root.
async fn fleet_on(
    scenario: &Scenario,
    edge: &PrivateMosquitto,
    devices: Vec<SimDevice>,
) -> idem_device_sim::Fleet {
    let broker = idem_device_sim::BrokerAddr::new(edge.host(), edge.port());
    let config = FleetConfig::new(broker, scenario.server.topic_root.clone(), devices);
    scenario.start_fleet_with(config).await.unwrap()
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A QoS 1 subscriber on `broker` to `topic`, returned once subscribed.
struct Probe {
    client: AsyncClient,
    eventloop: rumqttc::EventLoop,
    topic: String,
}

impl Probe {
    async fn subscribe(broker: &PrivateMosquitto, topic: &str) -> Self {
        let options = broker.mqtt_options(format!("probe-{}", uuid::Uuid::new_v4().simple()));
        let (client, mut eventloop) = AsyncClient::new(options, 10);
        client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
        loop {
            let event = tokio::time::timeout(Duration::from_secs(10), eventloop.poll())
                .await
                .expect("no SUBACK within 10 s")
                .unwrap();
            if let Event::Incoming(Packet::SubAck(_)) = event {
                break;
            }
        }
        Self {
            client,
            eventloop,
            topic: topic.to_owned(),
        }
    }

    /// The next message within 10 s: `(qos, retain, payload)`.
    async fn next(&mut self, broker: &PrivateMosquitto) -> (QoS, bool, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let Ok(event) = tokio::time::timeout_at(deadline.into(), self.eventloop.poll()).await
            else {
                panic!(
                    "nothing arrived on {} within 10 s\n{}",
                    self.topic,
                    broker.log_tail()
                );
            };
            let event = event.unwrap();
            if let Event::Incoming(Packet::Publish(p)) = event {
                return (p.qos, p.retain, p.payload.to_vec());
            }
        }
    }

    async fn close(self) {
        let _ = self.client.disconnect().await;
    }
}

/// The desired message `broker` itself retains on `topic` (what a device
/// subscribing there receives first), once it is `spec`: `(qos, desired)`.
/// A message that reaches a fresh subscriber live, without the retain flag,
/// is still on its way through the bridge: probed again.
async fn retained_desired(
    broker: &PrivateMosquitto,
    topic: &str,
    spec: &serde_json::Value,
) -> (QoS, Desired) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut probe = Probe::subscribe(broker, topic).await;
        let (qos, retain, payload) = probe.next(broker).await;
        probe.close().await;
        let desired = Desired::decode(&payload, SpecBudget::default()).unwrap();
        if retain && desired.spec == *spec {
            return (qos, desired);
        }
        assert!(
            Instant::now() < deadline,
            "the broker retains {:?} (retain flag {retain}), not {spec}",
            desired.spec
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_behind_two_edge_brokers_is_reconciled_exactly_as_on_one_broker() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("edge-", 40)
        .drifted(4)
        .seed(7)
        .build()
        .unwrap();
    let (west, east) = plan.devices.split_at(20);
    // One edge narrowed to its own devices, one taking every device's topics.
    let west_edge = edge(&scenario, "west", Some(west));
    let east_edge = edge(&scenario, "east", None);
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    let west_fleet = fleet_on(&scenario, &west_edge, west.to_vec()).await;
    let east_fleet = fleet_on(&scenario, &east_edge, east.to_vec()).await;
    scenario
        .wait_reports_stored(40, Duration::from_secs(30))
        .await
        .unwrap();

    let (run_id, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();

    assert_eq!(run["summary"], plan.expected_counts().summary(), "{run}");
    let client = ServerClient::with_auth(
        &scenario.server.url(""),
        &ClientAuth {
            token: scenario.server.token().map(SecretString::new),
            ca_file: None,
        },
    )
    .unwrap();
    let outcomes = client.outcomes(&run_id).await.unwrap();
    let check = check_outcomes(&plan, &outcomes);
    assert!(check.passed(), "{:?}", check.mismatching_devices());
    // The drifted devices run what the server pushed through the bridges.
    for id in plan.ids_expecting(idem_device_sim::ExpectedOutcome::Provisioned) {
        let state = west_fleet.state(&id).or_else(|| east_fleet.state(&id));
        assert_eq!(state.unwrap().spec, plan.desired_spec, "{id}");
    }
    west_fleet.shutdown().await.unwrap();
    east_fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retained_desired_message_reaches_edges_up_at_the_push_and_edges_started_after_it() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let device = SimDevice::new(DeviceId::parse("late-1").unwrap(), json!({"fw": "0.9"}));
    let up_edge = edge(&scenario, "up", Some(std::slice::from_ref(&device)));
    scenario
        .register(std::slice::from_ref(&device), &json!({"fw": "1.0"}))
        .await
        .unwrap();
    let fleet = fleet_on(&scenario, &up_edge, vec![device.clone()]).await;
    scenario
        .wait_reports_stored(1, Duration::from_secs(10))
        .await
        .unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(run["counts"]["provisioned"], 1, "{run}");
    // The device goes away, and its desired spec changes while it is away.
    fleet.take_offline(&device.id, OfflineMode::Clean).unwrap();
    let path = "/v1/devices/late-1";
    wait_for(
        "the server to see the device offline",
        Duration::from_secs(10),
        || async { scenario.server.get(path).await.unwrap().1["online"] == false },
    )
    .await;
    fleet.shutdown().await.unwrap();
    let (status, answer) = scenario
        .server
        .put(
            "/v1/devices/late-1/desired",
            &json!({"spec": {"fw": "2.0"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let topic = scenario
        .server
        .topic_root
        .topic(&device.id, Channel::Desired);

    // The edge that was bridged when the server published keeps it retained,
    // at QoS 1: the bridge kept the retain flag across the hop.
    let v2 = json!({"fw": "2.0"});
    let (qos, _) = retained_desired(&up_edge, &topic, &v2).await;
    assert_eq!(qos, QoS::AtLeastOnce);
    // An edge bridged afterwards gets it from the core when it subscribes.
    let late_edge = edge(&scenario, "late", Some(std::slice::from_ref(&device)));
    let (_, desired) = retained_desired(&late_edge, &topic, &v2).await;
    assert_eq!(desired.generation, Generation(2));

    // The device boots on the late edge and applies the retained message.
    let fleet = fleet_on(&scenario, &late_edge, vec![device.clone()]).await;
    wait_for("the device to run 2.0", Duration::from_secs(10), || async {
        fleet.state(&device.id).unwrap().spec == json!({"fw": "2.0"})
    })
    .await;
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_cross_at_qos_1_and_a_device_losing_power_on_an_edge_goes_offline_by_its_will() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let device = SimDevice::new(DeviceId::parse("will-1").unwrap(), json!({"fw": "1.0"}));
    let edge = edge(&scenario, "will", None);
    scenario
        .register(std::slice::from_ref(&device), &json!({"fw": "1.0"}))
        .await
        .unwrap();
    let reported = scenario
        .server
        .topic_root
        .topic(&device.id, Channel::Reported);
    // A subscriber on the core sees the edge device's report at QoS 1.
    let mut probe = Probe::subscribe(&scenario.broker, &reported).await;
    let fleet = fleet_on(&scenario, &edge, vec![device.clone()]).await;
    let (qos, _, _) = probe.next(&scenario.broker).await;
    probe.close().await;
    assert_eq!(
        qos,
        QoS::AtLeastOnce,
        "the report crossed the bridge below QoS 1"
    );
    let online =
        || async { scenario.server.get("/v1/devices/will-1").await.unwrap().1["online"].clone() };
    wait_for(
        "the server to see the device online",
        Duration::from_secs(10),
        || async { online().await == true },
    )
    .await;

    // Power loss: the edge publishes the device's will, the bridge carries
    // it to the core, and the server marks the device offline.
    fleet.take_offline(&device.id, OfflineMode::Abrupt).unwrap();
    wait_for(
        "the will to reach the server",
        Duration::from_secs(20),
        || async { online().await == false },
    )
    .await;
    fleet.shutdown().await.unwrap();
}
