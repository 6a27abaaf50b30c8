//! The MQTT client's overflow queue: what the engine and the ingest send
//! (desired pushes, report requests, acks) goes straight into the client's
//! request channel while it has room; once it is full, sends wait here, in
//! order, and one task hands them over as room frees up.
//!
//! The engine and the ingest never wait for room themselves: the event loop
//! that drains the channel may be waiting for them (inbound channel full),
//! which would deadlock. One waiting task, not one task per message: each
//! waiter on the client's channel is woken and re-scanned on every free
//! slot, so thousands of waiters cost time quadratic in their number
//! (measured: half the server's CPU during a 100,000-report burst).
//!
//! At shutdown [`Outbox::close`] waits until the task has handed over
//! everything that waits and ended, so a DISCONNECT queued after it follows
//! every send.
//!
//! Every QoS 1 publish of the server goes through here, so each gets a
//! ticket: its place in the order the client sends them. A broker answers
//! QoS 1 publishes of one connection in the order it received them (MQTT
//! 3.1.1 §4.6), so once [`PubAcks`] has counted `n` PUBACKs, every publish
//! with a ticket up to `n` has reached the broker: the event relay saves its
//! cursor only that far.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rumqttc::{AsyncClient, ClientError, Publish, QoS, Request};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// A request that found the client's channel full.
#[derive(Debug, Clone)]
enum Pending {
    Publish(Publish),
    Ack(Publish),
}

/// What waits, and whether the task that hands it over has ended.
#[derive(Debug, Default)]
struct Queue {
    /// In send order; the head stays until the client took it, so nothing
    /// sent later overtakes it.
    items: VecDeque<Pending>,
    /// Set by the task, under this lock, as it ends: nothing queued after
    /// that would ever be handed over.
    ended: bool,
    /// QoS 1 publishes ticketed so far (the last ticket given).
    tickets: u64,
}

/// The PUBACKs the broker sent the server's client, counted by its event
/// loop.
#[derive(Debug, Default)]
pub struct PubAcks {
    received: AtomicU64,
    wake: Notify,
}

impl PubAcks {
    /// One PUBACK arrived.
    pub fn received(&self) {
        self.received.fetch_add(1, Ordering::AcqRel);
        self.wake.notify_waiters();
    }

    /// Whether the publish with `ticket`, and every one before it, reached
    /// the broker within `limit`.
    pub async fn wait_through(&self, ticket: u64, limit: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.wake.notified();
                if self.received.load(Ordering::Acquire) >= ticket {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    /// Counts every publish up to `ticket` as answered: after a wait that
    /// timed out (a publish the client dropped is never answered), so that
    /// the count does not stay behind for good.
    pub fn forgive(&self, ticket: u64) {
        self.received.fetch_max(ticket, Ordering::AcqRel);
        self.wake.notify_waiters();
    }
}

/// See the module documentation. Shared by every clone of the publisher.
#[derive(Debug)]
pub struct Outbox {
    client: AsyncClient,
    acks: Arc<PubAcks>,
    waiting: Mutex<Queue>,
    wake: Notify,
    /// Set by [`Outbox::close`]: the task ends once nothing waits.
    closing: AtomicBool,
    /// The task, until [`Outbox::close`] waits for it.
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Outbox {
    /// The outbox of `client` and its task, which runs until [`Outbox::close`].
    pub fn start(client: AsyncClient) -> Arc<Self> {
        let outbox = Arc::new(Self {
            client,
            acks: Arc::default(),
            waiting: Mutex::new(Queue::default()),
            wake: Notify::new(),
            closing: AtomicBool::new(false),
            task: Mutex::new(None),
        });
        let task = tokio::spawn(Arc::clone(&outbox).drain());
        *outbox.task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
        outbox
    }

    /// The PUBACKs counted for this client.
    pub fn acks(&self) -> Arc<PubAcks> {
        self.acks.clone()
    }

    /// Publishes without waiting; a QoS 1 publish gets its ticket
    /// ([`PubAcks::wait_through`]). `what` names the message in the log if
    /// the client is gone.
    pub fn publish(
        &self,
        topic: String,
        qos: QoS,
        retain: bool,
        payload: Vec<u8>,
        what: &'static str,
    ) -> Option<u64> {
        let mut waiting = self.lock();
        let ticket = match qos {
            QoS::AtMostOnce => None,
            QoS::AtLeastOnce | QoS::ExactlyOnce => Some(waiting.tickets + 1),
        };
        let publish = if waiting.items.is_empty() {
            match self.client.try_publish(topic, qos, retain, payload) {
                Ok(()) => {
                    if let Some(ticket) = ticket {
                        waiting.tickets = ticket;
                    }
                    return ticket;
                }
                // The channel is full: the client hands the publish back.
                Err(ClientError::TryRequest(Request::Publish(publish))) => publish,
                Err(e) => {
                    tracing::error!(error = %e, what, "could not publish");
                    return None;
                }
            }
        } else {
            let mut publish = Publish::new(topic, qos, payload);
            publish.retain = retain;
            publish
        };
        if waiting.ended {
            drop(waiting);
            tracing::warn!(
                what,
                "the MQTT client's channel is full after shutdown began; not sent"
            );
            return None;
        }
        if let Some(ticket) = ticket {
            waiting.tickets = ticket;
        }
        self.enqueue(waiting, Pending::Publish(publish), what);
        ticket
    }

    /// Acknowledges an inbound QoS 1 publish without waiting.
    pub fn ack(&self, publish: &Publish) {
        let waiting = self.lock();
        if waiting.items.is_empty() {
            match self.client.try_ack(publish) {
                Ok(()) => return,
                Err(ClientError::TryRequest(_)) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not queue an MQTT ack");
                    return;
                }
            }
        }
        self.enqueue(waiting, Pending::Ack(publish.clone()), "ack");
    }

    /// Requests waiting for room in the client's channel.
    #[cfg(test)]
    pub fn backlog(&self) -> usize {
        self.lock().items.len()
    }

    /// Shutdown: lets the task hand every waiting request to the client,
    /// oldest first, and returns once it has and the task ended. A send
    /// after that which finds the channel full is dropped (and logged).
    pub async fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.wake.notify_one();
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                tracing::warn!(error = %e, "the MQTT outbox's task failed");
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock leaves a consistent queue.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a request that found the channel full (or others waiting).
    fn enqueue(&self, mut waiting: MutexGuard<'_, Queue>, pending: Pending, what: &'static str) {
        if waiting.ended {
            drop(waiting);
            tracing::warn!(
                what,
                "the MQTT client's channel is full after shutdown began; not sent"
            );
            return;
        }
        waiting.items.push_back(pending);
        drop(waiting);
        self.wake.notify_one();
    }

    /// Hands waiting requests to the client, oldest first, each once the
    /// channel has room; ends once closing and nothing waits.
    async fn drain(self: Arc<Self>) {
        loop {
            let head = {
                let mut waiting = self.lock();
                let head = waiting.items.front().cloned();
                if head.is_none() && self.closing.load(Ordering::Acquire) {
                    waiting.ended = true;
                    return;
                }
                head
            };
            let Some(head) = head else {
                self.wake.notified().await;
                continue;
            };
            let sent = self.send(head).await;
            self.lock().items.pop_front();
            if let Err(e) = sent {
                tracing::warn!(error = %e, "could not hand a waiting request to the MQTT client");
            }
        }
    }

    async fn send(&self, pending: Pending) -> Result<(), ClientError> {
        match pending {
            Pending::Publish(p) => {
                self.client
                    .publish_bytes(p.topic, p.qos, p.retain, p.payload)
                    .await
            }
            Pending::Ack(p) => self.client.ack(&p).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rumqttc::{AsyncClient, Publish, QoS, Request};

    use super::Outbox;

    /// What a request on the channel is, in a test's words.
    fn describe(request: &Request) -> String {
        if let Request::Publish(p) = request {
            return format!("publish {} {:?}", p.topic, p.payload);
        }
        if let Request::PubAck(ack) = request {
            return format!("ack {}", ack.pkid);
        }
        format!("{request:?}")
    }

    /// The next `n` requests the client's channel delivers, described.
    async fn received(rx: &flume::Receiver<Request>, n: usize) -> Vec<String> {
        let mut got = Vec::new();
        while got.len() < n {
            let request = tokio::time::timeout(Duration::from_secs(5), rx.recv_async())
                .await
                .expect("a waiting request never reached the client")
                .expect("channel open");
            got.push(describe(&request));
        }
        got
    }

    fn inbound(pkid: u16) -> Publish {
        let mut publish = Publish::new("r/d/reported", QoS::AtLeastOnce, b"{}".to_vec());
        publish.pkid = pkid;
        publish
    }

    #[tokio::test]
    async fn sends_beyond_a_full_channel_wait_and_reach_the_client_in_send_order() {
        // A channel of two, drained only after everything was sent.
        let (tx, rx) = flume::bounded(2);
        let outbox = Outbox::start(AsyncClient::from_senders(tx));
        let mut expected = Vec::new();
        for i in 0..6u16 {
            let topic = format!("r/d{i}/desired");
            outbox.publish(topic.clone(), QoS::AtLeastOnce, true, vec![b'a'; 3], "test");
            expected.push(format!("publish {topic} b\"aaa\""));
            outbox.ack(&inbound(i + 1));
            expected.push(format!("ack {}", i + 1));
        }
        assert_eq!(outbox.backlog(), 10, "two fit in the channel, ten wait");
        assert_eq!(received(&rx, expected.len()).await, expected);
        assert_eq!(outbox.backlog(), 0);
    }

    #[tokio::test]
    async fn a_send_after_the_queue_emptied_goes_straight_to_the_client() {
        let (tx, rx) = flume::bounded(1);
        let outbox = Outbox::start(AsyncClient::from_senders(tx));
        outbox.ack(&inbound(1));
        assert_eq!(outbox.backlog(), 0);
        assert_eq!(describe(&rx.recv_async().await.unwrap()), "ack 1");
        outbox.ack(&inbound(2));
        assert_eq!(outbox.backlog(), 0);
    }

    #[tokio::test]
    async fn a_send_while_others_wait_never_overtakes_them_even_when_the_channel_has_room() {
        let (tx, rx) = flume::bounded(1);
        let outbox = Outbox::start(AsyncClient::from_senders(tx));
        outbox.ack(&inbound(1));
        outbox.ack(&inbound(2));
        // A slot frees up before the outbox's task had a chance to run.
        assert_eq!(describe(&rx.try_recv().unwrap()), "ack 1");
        outbox.ack(&inbound(3));
        assert_eq!(received(&rx, 2).await, ["ack 2", "ack 3"]);
    }

    #[tokio::test]
    async fn closing_hands_every_waiting_send_to_the_client_before_it_returns() {
        let (tx, rx) = flume::bounded(1);
        let outbox = Outbox::start(AsyncClient::from_senders(tx));
        for pkid in 1..=4 {
            outbox.ack(&inbound(pkid));
        }
        assert_eq!(outbox.backlog(), 3, "one fits in the channel, three wait");
        let closing = tokio::spawn({
            let outbox = outbox.clone();
            async move { outbox.close().await }
        });
        assert_eq!(received(&rx, 3).await, ["ack 1", "ack 2", "ack 3"]);
        tokio::time::timeout(Duration::from_secs(5), closing)
            .await
            .expect("close never returned")
            .unwrap();
        let last = rx
            .try_recv()
            .expect("close returned before the last waiting ack reached the client");
        assert_eq!(describe(&last), "ack 4");
        assert_eq!(outbox.backlog(), 0);
    }

    #[tokio::test]
    async fn a_send_after_closing_that_finds_the_channel_full_is_dropped_not_left_waiting() {
        let (tx, rx) = flume::bounded(1);
        let outbox = Outbox::start(AsyncClient::from_senders(tx));
        outbox.close().await;
        outbox.ack(&inbound(1));
        outbox.ack(&inbound(2));
        assert_eq!(outbox.backlog(), 0, "nothing would ever hand it over");
        assert_eq!(describe(&rx.try_recv().unwrap()), "ack 1");
    }
}
