//! The hand-off from the MQTT event loop to the ingest: a queue the event
//! loop never waits on while it holds less than its byte budget, so the
//! connection keeps being read (and its keepalive answered) through any
//! backlog the database causes; and the backlog's figures (messages, bytes,
//! age of the oldest) for readiness and metrics.
//!
//! It owns the queued messages only; it never decides what to do with them.
//! Producers: the event loop, and for a while the drain of a dead
//! instance's session (`crate::mqtt::adopt`); one consumer (the ingest).
//! Manual acks belong to the connection a message came on: each message
//! says which ([`AckVia`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use bytes::Bytes;
use rumqttc::{AsyncClient, Publish};
use tokio_util::sync::CancellationToken;

/// One inbound publish for the ingest. `oversized` is the original payload
/// length when it was over the report limit; the payload itself was dropped
/// already, so one huge message never waits in the channel.
#[derive(Debug)]
pub struct Received {
    pub publish: Publish,
    pub oversized: Option<usize>,
    pub ack_via: AckVia,
}

impl Received {
    /// `publish` for the ingest, its payload dropped at once when it is
    /// over `max_payload_bytes` (a report exactly at the limit is kept).
    pub fn bounded(mut publish: Publish, max_payload_bytes: usize, ack_via: AckVia) -> Self {
        let len = publish.payload.len();
        let oversized = (len > max_payload_bytes).then(|| {
            publish.payload = Bytes::new();
            len
        });
        Self {
            publish,
            oversized,
            ack_via,
        }
    }
}

/// The server is stopping: a producer waiting for room gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancelled;

/// The connection that acknowledges a message once the ingest is done
/// with it.
#[derive(Debug, Clone)]
pub enum AckVia {
    /// The server's own connection (through its publisher).
    Server,
    /// A connection draining another instance's session.
    Adopted(AdoptedAcks),
}

/// Acknowledges on a drained session's connection and counts what it
/// still has to acknowledge (the drain ends only at zero).
#[derive(Debug, Clone)]
pub struct AdoptedAcks {
    client: AsyncClient,
    unacked: Arc<AtomicUsize>,
}

impl AdoptedAcks {
    pub fn new(client: AsyncClient) -> Self {
        Self {
            client,
            unacked: Arc::default(),
        }
    }

    /// One more message handed to the ingest.
    pub fn handed_over(&self) {
        self.unacked.fetch_add(1, Ordering::AcqRel);
    }

    /// Acknowledges `publish` on its own connection.
    pub fn ack(&self, publish: &Publish) {
        if let Err(e) = self.client.try_ack(publish) {
            tracing::warn!(error = %e, "could not acknowledge a message of a drained session; the broker keeps it in that session");
        }
        self.unacked.fetch_sub(1, Ordering::AcqRel);
    }

    /// Messages handed to the ingest and not acknowledged yet.
    pub fn unacked(&self) -> usize {
        self.unacked.load(Ordering::Acquire)
    }
}

/// What one queued message is counted as besides its topic and payload
/// (the `Publish` and queue slot around them).
const OVERHEAD_BYTES: usize = 160;

/// The queue's size at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    pub messages: usize,
    pub bytes: usize,
    /// How long the oldest queued message has waited.
    pub oldest: Duration,
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<(Received, Instant, usize)>,
    bytes: usize,
}

#[derive(Debug)]
struct Shared {
    queue: Mutex<Queue>,
    /// Wakes the consumer when a message arrives or the producer leaves.
    arrived: Notify,
    /// Wakes the producer when the queue fell below half its budget or the
    /// consumer left.
    drained: Notify,
    /// Producers still there; the queue closes when the last one leaves.
    producers: AtomicUsize,
    /// Every producer left.
    closed: AtomicBool,
    /// The consumer left (shutdown): nothing will drain the queue again.
    consumer_gone: AtomicBool,
    budget_bytes: usize,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The event loop's end.
#[derive(Debug)]
pub struct IntakeSender {
    shared: Arc<Shared>,
}

/// The ingest's end.
#[derive(Debug)]
pub struct IntakeReceiver {
    shared: Arc<Shared>,
}

/// Reads the backlog (readiness, metrics); cheap to clone.
#[derive(Debug, Clone)]
pub struct IntakeGauge {
    shared: Arc<Shared>,
}

/// A queue holding at most about `budget_bytes` before its sender is told
/// to wait.
pub fn intake(budget_bytes: usize) -> (IntakeSender, IntakeReceiver, IntakeGauge) {
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue::default()),
        arrived: Notify::new(),
        drained: Notify::new(),
        producers: AtomicUsize::new(1),
        closed: AtomicBool::new(false),
        consumer_gone: AtomicBool::new(false),
        budget_bytes: budget_bytes.max(1),
    });
    (
        IntakeSender {
            shared: shared.clone(),
        },
        IntakeReceiver {
            shared: shared.clone(),
        },
        IntakeGauge { shared },
    )
}

fn size_of(received: &Received) -> usize {
    received.publish.topic.len() + received.publish.payload.len() + OVERHEAD_BYTES
}

impl IntakeSender {
    /// A second producer on the same queue (it closes once both left).
    pub fn another(&self) -> Self {
        self.shared.producers.fetch_add(1, Ordering::AcqRel);
        Self {
            shared: self.shared.clone(),
        }
    }

    pub fn budget_bytes(&self) -> usize {
        self.shared.budget_bytes
    }

    /// Queues `received` without waiting; `false` when the queue is now
    /// over its budget (the caller should [`IntakeSender::wait_for_room`]
    /// before it reads more).
    pub fn push(&self, received: Received) -> bool {
        let size = size_of(&received);
        let within = {
            let mut queue = self.shared.lock();
            queue.items.push_back((received, Instant::now(), size));
            queue.bytes += size;
            queue.bytes <= self.shared.budget_bytes
        };
        self.shared.arrived.notify_one();
        within
    }

    /// Queues `received`; when the queue is then past its budget, calls
    /// `on_full` and waits for room (see [`IntakeSender::wait_for_room`])
    /// before returning, so the producer reads nothing more meanwhile.
    pub async fn push_and_make_room(
        &self,
        received: Received,
        token: &CancellationToken,
        on_full: impl FnOnce(),
    ) -> Result<(), Cancelled> {
        if self.push(received) {
            return Ok(());
        }
        on_full();
        tokio::select! {
            () = token.cancelled() => Err(Cancelled),
            () = self.wait_for_room() => Ok(()),
        }
    }

    /// Waits until the queue holds at most half its budget, or until the
    /// ingest is gone (shutdown): then waiting would only stop the event
    /// loop from sending what the server still has to send.
    pub async fn wait_for_room(&self) {
        loop {
            let drained = self.shared.drained.notified();
            if self.shared.consumer_gone.load(Ordering::Acquire)
                || self.shared.lock().bytes <= self.shared.budget_bytes / 2
            {
                return;
            }
            drained.await;
        }
    }
}

impl Drop for IntakeSender {
    fn drop(&mut self) {
        if self.shared.producers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.shared.closed.store(true, Ordering::Release);
            self.shared.arrived.notify_one();
        }
    }
}

impl Drop for IntakeReceiver {
    fn drop(&mut self) {
        self.shared.consumer_gone.store(true, Ordering::Release);
        self.shared.drained.notify_waiters();
    }
}

impl IntakeReceiver {
    /// Waits for messages and moves up to `limit` of them into `into`;
    /// `0` once the sender is gone and the queue is empty.
    pub async fn recv_many(&mut self, into: &mut Vec<Received>, limit: usize) -> usize {
        loop {
            let arrived = self.shared.arrived.notified();
            let taken = {
                let mut queue = self.shared.lock();
                let queue = &mut *queue;
                let n = queue.items.len().min(limit);
                for (received, _, size) in queue.items.drain(..n) {
                    queue.bytes -= size;
                    into.push(received);
                }
                if queue.bytes <= self.shared.budget_bytes / 2 {
                    self.shared.drained.notify_waiters();
                }
                n
            };
            if taken > 0 {
                return taken;
            }
            if self.shared.closed.load(Ordering::Acquire) {
                return 0;
            }
            arrived.await;
        }
    }
}

impl IntakeGauge {
    /// The backlog at `now`.
    pub fn backlog(&self, now: Instant) -> Backlog {
        let queue = self.shared.lock();
        Backlog {
            messages: queue.items.len(),
            bytes: queue.bytes,
            oldest: queue.items.front().map_or(Duration::ZERO, |(_, at, _)| {
                now.saturating_duration_since(*at)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::{Publish, QoS};

    fn message(payload: usize) -> Received {
        Received {
            publish: Publish::new("idem/v1/d/reported", QoS::AtLeastOnce, vec![b'x'; payload]),
            oversized: None,
            ack_via: AckVia::Server,
        }
    }

    #[tokio::test]
    async fn messages_arrive_in_order_and_the_backlog_counts_what_waits() {
        let (tx, mut rx, gauge) = intake(1 << 20);
        for n in 0..5 {
            assert!(tx.push(message(n)));
        }
        let backlog = gauge.backlog(Instant::now());
        assert_eq!(backlog.messages, 5);
        assert_eq!(backlog.bytes, 5 * (18 + OVERHEAD_BYTES) + (1 + 2 + 3 + 4));
        let mut got = Vec::new();
        assert_eq!(rx.recv_many(&mut got, 3).await, 3);
        assert_eq!(rx.recv_many(&mut got, 10).await, 2);
        let sizes: Vec<usize> = got.iter().map(|r| r.publish.payload.len()).collect();
        assert_eq!(sizes, [0, 1, 2, 3, 4]);
        assert_eq!(gauge.backlog(Instant::now()), Backlog::default());
    }

    #[tokio::test]
    async fn a_push_never_waits_and_says_when_the_budget_is_passed() {
        let (tx, mut rx, _gauge) = intake(1_000);
        assert!(tx.push(message(100)));
        assert!(!tx.push(message(900)), "over the budget");
        // Still queued, and room comes back once the ingest drains it.
        let waiting = tokio::spawn(async move {
            tx.wait_for_room().await;
            tx
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        let mut got = Vec::new();
        assert_eq!(rx.recv_many(&mut got, 10).await, 2);
        let tx = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("room was not announced")
            .unwrap();
        drop(tx);
        assert_eq!(rx.recv_many(&mut got, 10).await, 0, "closed and empty");
    }

    #[test]
    fn a_report_at_the_limit_keeps_its_payload_and_one_byte_more_is_dropped_at_once() {
        let publish =
            |len: usize| Publish::new("idem/v1/d/reported", QoS::AtLeastOnce, vec![b'x'; len]);
        let at_limit = Received::bounded(publish(100), 100, AckVia::Server);
        assert_eq!(at_limit.oversized, None);
        assert_eq!(at_limit.publish.payload.len(), 100);
        let over = Received::bounded(publish(101), 100, AckVia::Server);
        assert_eq!(over.oversized, Some(101));
        assert!(
            over.publish.payload.is_empty(),
            "the payload does not wait in the queue"
        );
        let small = Received::bounded(publish(1), 100, AckVia::Server);
        assert_eq!((small.oversized, small.publish.payload.len()), (None, 1));
    }

    #[tokio::test]
    async fn a_push_within_the_budget_returns_at_once_even_past_half_of_it() {
        let (tx, _rx, _gauge) = intake(1_000);
        let token = CancellationToken::new();
        let mut full = false;
        let pushed = tokio::time::timeout(
            Duration::from_secs(5),
            tx.push_and_make_room(message(600), &token, || full = true),
        )
        .await;
        assert_eq!(pushed, Ok(Ok(())), "did not wait");
        assert!(!full);
    }

    #[tokio::test]
    async fn a_push_past_the_budget_says_so_and_waits_until_the_ingest_made_room() {
        let (tx, mut rx, _gauge) = intake(1_000);
        let waiting = tokio::spawn(async move {
            let mut full = 0;
            let pushed = tx
                .push_and_make_room(message(2_000), &CancellationToken::new(), || full += 1)
                .await;
            (pushed, full)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "it waits for room");
        let mut got = Vec::new();
        assert_eq!(rx.recv_many(&mut got, 10).await, 1);
        let finished = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("room was not announced")
            .unwrap();
        assert_eq!(finished, (Ok(()), 1));
    }

    #[tokio::test]
    async fn a_push_waiting_for_room_gives_up_when_the_server_stops() {
        let (tx, _rx, _gauge) = intake(1_000);
        let token = CancellationToken::new();
        token.cancel();
        let pushed = tokio::time::timeout(
            Duration::from_secs(5),
            tx.push_and_make_room(message(2_000), &token, || {}),
        )
        .await;
        assert_eq!(pushed, Ok(Err(Cancelled)));
    }

    #[tokio::test]
    async fn the_queue_closes_only_when_its_last_producer_leaves() {
        let (first, mut rx, _gauge) = intake(1 << 20);
        let second = first.another();
        drop(first);
        assert!(second.push(message(1)));
        let mut got = Vec::new();
        assert_eq!(rx.recv_many(&mut got, 10).await, 1, "still open");
        drop(second);
        assert_eq!(rx.recv_many(&mut got, 10).await, 0, "closed and empty");
    }

    #[tokio::test]
    async fn every_producer_waiting_for_room_hears_that_the_ingest_drained() {
        let (first, mut rx, _gauge) = intake(1_000);
        let second = first.another();
        assert!(!first.push(message(2_000)), "over the budget");
        let waiters = [first, second].map(|tx| {
            tokio::spawn(async move {
                tx.wait_for_room().await;
                tx
            })
        });
        tokio::task::yield_now().await;
        let mut got = Vec::new();
        assert_eq!(rx.recv_many(&mut got, 10).await, 1);
        for waiter in waiters {
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("a producer was not told there is room")
                .unwrap();
        }
    }

    #[tokio::test]
    async fn a_full_queue_stops_holding_the_event_loop_once_the_ingest_is_gone() {
        let (tx, rx, _gauge) = intake(1_000);
        assert!(!tx.push(message(2_000)), "over the budget");
        let waiting = tokio::spawn(async move { tx.wait_for_room().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the ingest may still drain it");
        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the event loop still waits for an ingest that is gone")
            .unwrap();
    }
}
