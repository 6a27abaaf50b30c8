//! An independent observer of pushes: a QoS 1 subscriber on
//! `{root}/+/desired` that counts, per device and generation, the desired
//! messages the broker delivered live (not the retained copy a new
//! subscription receives) — the ground truth for "how often was this device
//! pushed this generation", whatever the server under test believes.
//!
//! It owns one MQTT client and its polling task; it never publishes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Result};
use idem_protocol::{Channel, Desired, SpecBudget, TopicRoot};
use rumqttc::{AsyncClient, Event, Packet};
use tokio::task::JoinHandle;

use crate::broker::{subscribe_acknowledged, PrivateMosquitto};

#[derive(Debug, Default)]
struct Pushes {
    /// (device id, generation) → live desired messages delivered.
    by_generation: HashMap<(String, u64), u32>,
    /// Every live desired message as it arrived: when, device, generation.
    arrivals: Vec<(std::time::Instant, String, u64)>,
    /// Set when the connection broke: the counts are then worthless.
    lost: Option<String>,
}

/// Counts the desired messages published to each device, per generation.
pub struct PushWitness {
    pushes: Arc<Mutex<Pushes>>,
    client: AsyncClient,
    task: JoinHandle<()>,
}

impl PushWitness {
    /// Subscribes (clean session, QoS 1) and waits for the SUBACK, so every
    /// push the broker accepts afterwards is counted.
    pub async fn start(broker: &PrivateMosquitto, root: &TopicRoot) -> Result<Self> {
        let mut options =
            broker.mqtt_options(format!("push-witness-{}", uuid::Uuid::new_v4().simple()));
        options.set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        subscribe_acknowledged(
            &client,
            &mut eventloop,
            &[root.filter(Channel::Desired)],
            "the push witness",
        )
        .await?;
        let pushes = Arc::new(Mutex::new(Pushes::default()));
        let sink = Arc::clone(&pushes);
        let root = root.clone();
        let task = tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    // A retained copy is what a subscription finds, not a push.
                    Ok(Event::Incoming(Packet::Publish(p))) if !p.retain => {
                        let device = root.parse(&p.topic).map(|t| t.device.to_string());
                        let desired = Desired::decode(&p.payload, SpecBudget::default());
                        if let (Ok(device), Ok(desired)) = (device, desired) {
                            let mut pushes = sink.lock().unwrap_or_else(PoisonError::into_inner);
                            *pushes
                                .by_generation
                                .entry((device.clone(), desired.generation.get()))
                                .or_insert(0) += 1;
                            let at = std::time::Instant::now();
                            pushes.arrivals.push((at, device, desired.generation.get()));
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
        Ok(Self {
            pushes,
            client,
            task,
        })
    }

    /// Every push delivered so far in the order it arrived, with when:
    /// `(arrived, device id, generation)`; fails if the witness's
    /// connection broke.
    pub fn arrivals(&self) -> Result<Vec<(std::time::Instant, String, u64)>> {
        let pushes = self.pushes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(error) = &pushes.lost {
            bail!("the push witness lost its connection: {error}");
        }
        Ok(pushes.arrivals.clone())
    }

    /// (device id, generation) → pushes delivered so far; fails if the
    /// witness's connection broke (it may have missed some).
    pub fn pushes(&self) -> Result<HashMap<(String, u64), u32>> {
        let pushes = self.pushes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(error) = &pushes.lost {
            bail!("the push witness lost its connection: {error}");
        }
        Ok(pushes.by_generation.clone())
    }
}

impl Drop for PushWitness {
    fn drop(&mut self) {
        // Best effort: the task is aborted right after either way.
        let _ = self.client.try_disconnect();
        self.task.abort();
    }
}
