//! The bare counting subscriber of the ingest step: the rate a minimal MQTT
//! client receives the burst of reports at, the yardstick of the server's
//! stored rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use idem_protocol::{Channel, TopicRoot};
use idem_tests::PrivateMosquitto;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

/// The bare counting subscriber's client id and (with `--secure`) user.
pub const COUNTER_USER: &str = "idem-bench-counter";

/// A minimal rumqttc client subscribed (QoS 1) to `{root}/+/reported` that
/// only counts publishes and remembers when the `target`-th arrived.
pub struct Counter {
    pub count: Arc<AtomicU64>,
    reached: Arc<Mutex<Option<Instant>>>,
    client: AsyncClient,
    task: tokio::task::JoinHandle<()>,
}

impl Counter {
    pub async fn start(
        broker: &PrivateMosquitto,
        root: &TopicRoot,
        target: u64,
        password: Option<&str>,
    ) -> Result<Self> {
        let mut options: MqttOptions = broker.mqtt_options(COUNTER_USER);
        options.set_keep_alive(Duration::from_secs(30));
        if let Some(password) = password {
            options.set_credentials(COUNTER_USER, password);
        }
        let (client, mut eventloop) = AsyncClient::new(options, 10);
        client
            .subscribe(root.filter(Channel::Reported), QoS::AtLeastOnce)
            .await
            .context("subscribing the counter")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let event = tokio::time::timeout_at(deadline.into(), eventloop.poll())
                .await
                .context("no SUBACK for the counter within 10 s")?
                .context("counter connection")?;
            if let Event::Incoming(Packet::SubAck(_)) = event {
                break;
            }
        }
        let count = Arc::new(AtomicU64::new(0));
        let reached = Arc::new(Mutex::new(None));
        let (c, r) = (Arc::clone(&count), Arc::clone(&reached));
        let task = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if let Event::Incoming(Packet::Publish(_)) = event {
                    if c.fetch_add(1, Ordering::Relaxed) + 1 == target {
                        *r.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
                    }
                }
            }
        });
        Ok(Self {
            count,
            reached,
            client,
            task,
        })
    }

    pub fn reached(&self) -> Option<Instant> {
        *self.reached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub async fn stop(self) {
        // Best effort: the task is aborted either way.
        let _ = self.client.disconnect().await;
        self.task.abort();
    }
}
