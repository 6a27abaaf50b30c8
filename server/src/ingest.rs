//! Report ingest: classifies inbound MQTT messages (pure), stores accepted
//! reports in batches, acknowledges them only after their batch commits, then
//! tells the engine which devices have news.
//!
//! Bad input is refused with a counted reason and never stops the batch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_protocol::{Channel, DeviceId, Reported, SpecDigest, Status, TopicRoot};
use rumqttc::Publish;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::fleet::Fleet;
use crate::metrics::{Metrics, ReportResult};
use crate::mqtt::Publisher;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::engine::EngineCommand;
use crate::store::devices::ReportRow;
use crate::store::{self, DeviceWrites, StoreError};

/// Most messages stored in one database batch.
const MAX_BATCH: usize = 4_096;

/// One inbound message, understood.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    Report {
        device: DeviceId,
        report: Reported,
    },
    Status {
        device: DeviceId,
        online: bool,
    },
    Rejected {
        reason: &'static str,
        detail: String,
    },
}

/// Parses topic and payload. Pure: no state, no IO.
pub fn classify(root: &TopicRoot, topic: &str, payload: &[u8], max_payload: usize) -> Inbound {
    let parsed = match root.parse(topic) {
        Ok(p) => p,
        Err(e) => {
            return Inbound::Rejected {
                reason: e.reason(),
                detail: e.to_string(),
            }
        }
    };
    match parsed.channel {
        Channel::Reported => match Reported::decode(payload, max_payload) {
            Ok(report) if i64::try_from(report.seq).is_err() => Inbound::Rejected {
                reason: "malformed",
                detail: format!(
                    "seq {} is above the supported maximum {}",
                    report.seq,
                    i64::MAX
                ),
            },
            Ok(report) => Inbound::Report {
                device: parsed.device,
                report,
            },
            Err(e) => Inbound::Rejected {
                reason: e.reason(),
                detail: e.to_string(),
            },
        },
        Channel::Status => match Status::decode(payload) {
            Ok(status) => Inbound::Status {
                device: parsed.device,
                online: status == Status::Online,
            },
            Err(e) => Inbound::Rejected {
                reason: e.reason(),
                detail: e.to_string(),
            },
        },
        Channel::Desired | Channel::Get => Inbound::Rejected {
            reason: "unknown_channel",
            detail: format!("{} is a server-to-device topic", parsed.channel.as_str()),
        },
    }
}

/// Where a report's seq stands against the highest one seen for its device.
pub fn seq_verdict(seq: u64, highest: Option<u64>) -> ReportResult {
    match highest {
        Some(h) if seq == h => ReportResult::Duplicate,
        Some(h) if seq < h => ReportResult::Stale,
        Some(_) | None => ReportResult::Applied,
    }
}

pub struct Ingest {
    pub pool: PgPool,
    pub fleet: Arc<Fleet>,
    pub metrics: Arc<Metrics>,
    pub publisher: Publisher,
    pub engine: mpsc::Sender<EngineCommand>,
    pub root: TopicRoot,
    pub max_payload: usize,
    pub auto_register: bool,
    pub device_writes: DeviceWrites,
}

/// A batch's accepted work, latest report per device.
#[derive(Default)]
struct Batch {
    reports: HashMap<DeviceId, (Reported, SpecDigest)>,
    online: HashMap<DeviceId, bool>,
}

impl Ingest {
    pub async fn run(self, mut inbound: mpsc::Receiver<Publish>, token: CancellationToken) {
        let mut messages = Vec::with_capacity(MAX_BATCH);
        loop {
            let received = tokio::select! {
                () = token.cancelled() => break,
                n = inbound.recv_many(&mut messages, MAX_BATCH) => n,
            };
            if received == 0 {
                break;
            }
            self.process(&messages, &token).await;
            messages.clear();
        }
    }

    async fn process(&self, messages: &[Publish], token: &CancellationToken) {
        let batch = self.sort(messages);
        if !self.store(&batch, token).await {
            // Cancelled before the batch committed: leave the messages
            // unacknowledged so the broker delivers them again.
            return;
        }
        let mut applied = Vec::with_capacity(batch.reports.len());
        for (device, (report, digest)) in batch.reports {
            let state = ReportedState {
                seq: report.seq,
                digest,
                generation: report.generation,
                rejection: report.error.map(|e| (e.generation, e.message)),
            };
            self.fleet.set_reported(&device, state, report.health);
            applied.push(device);
        }
        let mut connectivity = Vec::new();
        for (device, online) in batch.online {
            if self.fleet.set_online(&device, online) != Some(online) {
                connectivity.push((device, online));
            }
        }
        for publish in messages {
            self.publisher.ack(publish).await;
        }
        if !connectivity.is_empty() {
            self.tell_engine(EngineCommand::Connectivity(connectivity))
                .await;
        }
        if !applied.is_empty() {
            self.tell_engine(EngineCommand::ReportsApplied(applied))
                .await;
        }
    }

    async fn tell_engine(&self, command: EngineCommand) {
        if self.engine.send(command).await.is_err() {
            tracing::debug!("engine stopped; stored reports get no follow-up now");
        }
    }

    /// Classifies every message and keeps the newest report per device.
    fn sort(&self, messages: &[Publish]) -> Batch {
        let mut batch = Batch::default();
        for publish in messages {
            match classify(
                &self.root,
                &publish.topic,
                &publish.payload,
                self.max_payload,
            ) {
                Inbound::Report { device, report } => {
                    let Some(stored) = self.known_seq(&device) else {
                        self.metrics.reject("unknown_device");
                        tracing::debug!(%device, "report from an unregistered device refused");
                        continue;
                    };
                    let highest = batch.reports.get(&device).map(|(r, _)| r.seq).max(stored);
                    let verdict = seq_verdict(report.seq, highest);
                    self.metrics.report(verdict).increment(1);
                    match verdict {
                        ReportResult::Applied => {
                            let digest = SpecDigest::of(&report.spec);
                            batch.reports.insert(device, (report, digest));
                        }
                        ReportResult::Duplicate | ReportResult::Stale | ReportResult::Rejected => {}
                    }
                }
                Inbound::Status { device, online } => {
                    if self.fleet.contains(&device) {
                        batch.online.insert(device, online);
                    } else {
                        self.metrics.reject("unknown_device");
                    }
                }
                Inbound::Rejected { reason, detail } => {
                    self.metrics.reject(reason);
                    tracing::debug!(topic = %publish.topic, reason, %detail, "inbound message refused");
                }
            }
        }
        batch
    }

    /// `Some(highest seq)` for a device whose reports we accept.
    fn known_seq(&self, device: &DeviceId) -> Option<Option<u64>> {
        match self.fleet.reported_seq(device) {
            Some(seq) => Some(seq),
            None if self.auto_register => Some(None),
            None => None,
        }
    }

    /// Stores the batch, retrying until it commits; false if cancelled first.
    async fn store(&self, batch: &Batch, token: &CancellationToken) -> bool {
        if batch.reports.is_empty() && batch.online.is_empty() {
            return true;
        }
        let rows: Vec<ReportRow> = batch
            .reports
            .iter()
            .map(|(device, (report, digest))| ReportRow {
                id: device.to_string(),
                seq: report.seq,
                spec: report.spec.clone(),
                digest: digest.to_string(),
                generation: report.generation,
                error_generation: report.error.as_ref().map(|e| e.generation),
                error: report.error.as_ref().map(|e| e.message.clone()),
                health: report.health.map(|h| h.as_str().to_owned()),
            })
            .collect();
        let online: Vec<(String, bool)> = batch
            .online
            .iter()
            .map(|(d, o)| (d.to_string(), *o))
            .collect();
        let mut backoff = Duration::from_millis(100);
        loop {
            let started = Instant::now();
            match self.write(&rows, &online).await {
                Ok(()) => {
                    self.metrics
                        .db_batch_ingest
                        .record(started.elapsed().as_secs_f64());
                    return true;
                }
                Err(e) => {
                    tracing::error!(error = %e, "storing reports failed; retrying in {backoff:?}");
                    tokio::select! {
                        () = token.cancelled() => return false,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn write(&self, rows: &[ReportRow], online: &[(String, bool)]) -> Result<(), StoreError> {
        let _one_writer = self.device_writes.lock().await;
        let mut tx = self.pool.begin().await.map_err(|e| StoreError::Db {
            context: "starting a transaction",
            source: e,
        })?;
        store::devices::apply_reports(&mut tx, rows, self.auto_register).await?;
        store::devices::set_online(&mut tx, online).await?;
        tx.commit().await.map_err(|e| StoreError::Db {
            context: "committing reports",
            source: e,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> TopicRoot {
        TopicRoot::new("idem/v1").unwrap()
    }

    #[test]
    fn a_valid_report_is_classified_with_its_device() {
        let got = classify(
            &root(),
            "idem/v1/pump-1/reported",
            br#"{"seq":5,"spec":{"a":1}}"#,
            1024,
        );
        let Inbound::Report { device, report } = got else {
            panic!("expected a report, got {got:?}")
        };
        assert_eq!(device.as_str(), "pump-1");
        assert_eq!(report.seq, 5);
    }

    #[test]
    fn bad_messages_are_rejected_with_a_reason() {
        let cases: [(&str, &[u8], &str); 6] = [
            ("idem/v1/pump-1/reported", b"{oops", "malformed"),
            ("idem/v1/pump-1/reported", &[b' '; 2000], "oversized"),
            (
                "idem/v1/$bad/reported",
                br#"{"seq":1,"spec":{}}"#,
                "invalid_device_id",
            ),
            ("idem/v1/pump-1/status", b"maybe", "invalid_status"),
            ("idem/v1/pump-1/desired", b"{}", "unknown_channel"),
            (
                "idem/v1/pump-1/reported",
                br#"{"seq":18446744073709551615,"spec":{}}"#,
                "malformed",
            ),
        ];
        for (topic, payload, expected) in cases {
            match classify(&root(), topic, payload, 1024) {
                Inbound::Rejected { reason, .. } => assert_eq!(reason, expected, "{topic}"),
                other @ (Inbound::Report { .. } | Inbound::Status { .. }) => {
                    panic!("{topic}: expected rejection, got {other:?}")
                }
            }
        }
    }

    #[test]
    fn status_messages_carry_online_or_offline() {
        assert_eq!(
            classify(&root(), "idem/v1/d/status", b"offline", 1024),
            Inbound::Status {
                device: DeviceId::parse("d").unwrap(),
                online: false
            }
        );
    }

    #[test]
    fn reports_at_or_below_the_highest_seq_are_duplicates_or_stale() {
        assert_eq!(seq_verdict(5, None), ReportResult::Applied);
        assert_eq!(seq_verdict(6, Some(5)), ReportResult::Applied);
        assert_eq!(seq_verdict(5, Some(5)), ReportResult::Duplicate);
        assert_eq!(seq_verdict(4, Some(5)), ReportResult::Stale);
    }
}
