//! Reading what a private broker retains on a topic, as a device that
//! subscribes afresh would get it.

use std::time::{Duration, Instant};

use rumqttc::{AsyncClient, Event, Packet, QoS};

use super::PrivateMosquitto;

impl PrivateMosquitto {
    /// The retained message a fresh subscriber gets on `topic`: `None` when
    /// the broker holds none. A marker published after subscribing tells
    /// "nothing retained" from "not delivered yet": retained messages come
    /// first. Panics (test code) when the broker answers neither in 5 s.
    #[allow(clippy::unwrap_used, clippy::expect_used)]
    pub async fn retained_on(&self, topic: &str) -> Option<Vec<u8>> {
        let options =
            self.mqtt_options(format!("retained-probe-{}", uuid::Uuid::new_v4().simple()));
        let (client, mut eventloop) = AsyncClient::new(options, 10);
        client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
        let marker = b"retained-probe-marker".to_vec();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut marker_sent = false;
        loop {
            let event = tokio::time::timeout_at(deadline.into(), eventloop.poll())
                .await
                .expect("the probe got neither a retained message nor its marker")
                .unwrap();
            match event {
                Event::Incoming(Packet::SubAck(_)) if !marker_sent => {
                    client
                        .publish(topic, QoS::AtLeastOnce, false, marker.clone())
                        .await
                        .unwrap();
                    marker_sent = true;
                }
                Event::Incoming(Packet::Publish(p)) => {
                    let _ = client.try_disconnect();
                    if p.retain {
                        return Some(p.payload.to_vec());
                    }
                    if p.payload.as_ref() == marker.as_slice() {
                        return None;
                    }
                }
                Event::Incoming(_) | Event::Outgoing(_) => {}
            }
        }
    }

    /// Waits until a fresh subscriber to `topic` gets no retained message
    /// (the server clears retained messages through its publishing queue,
    /// after the HTTP answer): `Err` with the message still retained when
    /// `within` runs out.
    pub async fn wait_nothing_retained_on(
        &self,
        topic: &str,
        within: Duration,
    ) -> Result<(), Vec<u8>> {
        let deadline = Instant::now() + within;
        loop {
            match self.retained_on(topic).await {
                None => return Ok(()),
                Some(payload) if Instant::now() >= deadline => return Err(payload),
                Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}
