//! An independent observer of device reports: a QoS 1 subscriber on
//! `{root}/+/reported` that records, per device, the highest `seq` the broker
//! accepted and delivered — the ground truth for "the highest seq a device
//! published", whatever the server under test did with it.
//!
//! It owns one MQTT client and its polling task; it never publishes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Result};
use idem_protocol::{Channel, Reported, SpecBudget, TopicRoot};
use rumqttc::{AsyncClient, Event, Packet};
use tokio::task::JoinHandle;

use crate::broker::{subscribe_acknowledged, PrivateMosquitto};

/// What the witness has seen so far.
#[derive(Debug, Default)]
struct Seen {
    /// Device id → highest seq in a report delivered to us.
    highest: HashMap<String, u64>,
    /// Reports delivered (valid ones).
    reports: u64,
    /// Payloads on the reported topic that were not valid reports.
    invalid: u64,
    /// Set when the connection broke: from then on the witness may have
    /// missed reports and its answers are worthless.
    lost: Option<String>,
}

/// Records the highest reported `seq` per device, as the broker delivers it.
pub struct ReportWitness {
    seen: Arc<Mutex<Seen>>,
    client: AsyncClient,
    task: JoinHandle<()>,
}

impl ReportWitness {
    /// Subscribes (clean session, QoS 1) and waits for the SUBACK, so every
    /// report the broker accepts afterwards is seen.
    pub async fn start(broker: &PrivateMosquitto, root: &TopicRoot) -> Result<Self> {
        Self::start_as(broker, root, None).await
    }

    /// [`ReportWitness::start`], logged in as `login` (user, password).
    pub async fn start_as(
        broker: &PrivateMosquitto,
        root: &TopicRoot,
        login: Option<(&str, &str)>,
    ) -> Result<Self> {
        let client_id = format!("report-witness-{}", uuid::Uuid::new_v4().simple());
        let mut options = match login {
            Some((user, password)) => broker.mqtt_options_as(client_id, user, password),
            None => broker.mqtt_options(client_id),
        };
        options.set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        subscribe_acknowledged(
            &client,
            &mut eventloop,
            &[root.filter(Channel::Reported)],
            "the report witness",
        )
        .await?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sink = Arc::clone(&seen);
        let root = root.clone();
        let task = tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let device = root.parse(&p.topic).map(|t| t.device.to_string());
                        let report = Reported::decode(&p.payload, SpecBudget::default());
                        let mut seen = sink.lock().unwrap_or_else(PoisonError::into_inner);
                        match (device, report) {
                            (Ok(device), Ok(report)) => {
                                seen.reports += 1;
                                let highest = seen.highest.entry(device).or_insert(0);
                                *highest = (*highest).max(report.seq);
                            }
                            (Err(_), _) | (_, Err(_)) => seen.invalid += 1,
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        sink.lock().unwrap_or_else(PoisonError::into_inner).lost =
                            Some(e.to_string());
                        return;
                    }
                }
            }
        });
        Ok(Self { seen, client, task })
    }

    /// Device id → highest seq seen so far.
    pub fn highest(&self) -> HashMap<String, u64> {
        self.lock().highest.clone()
    }

    /// Valid reports seen so far.
    pub fn reports(&self) -> u64 {
        self.lock().reports
    }

    /// Invalid payloads seen on the reported topic.
    pub fn invalid(&self) -> u64 {
        self.lock().invalid
    }

    /// Fails if the witness's connection broke (it may have missed reports).
    pub fn check_intact(&self) -> Result<()> {
        match &self.lock().lost {
            Some(error) => bail!("the report witness lost its connection: {error}"),
            None => Ok(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for ReportWitness {
    fn drop(&mut self) {
        // Best effort: the task is aborted right after either way.
        let _ = self.client.try_disconnect();
        self.task.abort();
    }
}
