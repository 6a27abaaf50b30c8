//! Report ingest: classifies inbound MQTT messages (pure), stores accepted
//! reports in batches, acknowledges them only after their batch commits, then
//! tells the engine which devices have news.
//!
//! Bad input is refused with a counted reason and never stops the batch:
//! everything PostgreSQL would refuse is caught by `classify` first, and a
//! batch the database still refuses is split until the refused report is
//! alone; that one is dropped (counted `db_refused`, acknowledged so the
//! broker stops redelivering it) and the rest commit.

use crate::mqtt::intake::IntakeReceiver;
use crate::mqtt::recheck_signal::{RecheckSignal, RecheckTrigger};
use std::cell::OnceCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idem_protocol::limits::seq_ceiling;
use idem_protocol::{
    Backoff, Channel, DeviceId, Health, Reported, SpecBudget, SpecDigest, Status, TopicRoot,
};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::EngineCommand;
use crate::mqtt::{AckVia, Publisher, Received};
use crate::ops::metrics::{Metrics, ReportResult};
use crate::ops::stall::Stall;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::diff::{drift_paths, DriftPaths};
use crate::reconcile::owned::OwnedFields;
use crate::store::cache::{FleetCache, FleetChange};
use crate::store::devices::ReportRow;
use crate::store::{self, DeviceWriter, StoreError};
use crate::tuning::INGEST_BATCH;

/// One inbound message, understood.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    Report {
        device: DeviceId,
        report: Reported,
        /// The spec's canonical digest (computed while decoding).
        digest: SpecDigest,
    },
    Status {
        device: DeviceId,
        online: bool,
    },
    /// An empty retained `status`: the retained message was cleared (by the
    /// server when a device is deleted). Nothing to do.
    StatusCleared,
    Rejected {
        reason: &'static str,
        detail: String,
        /// Arrived on a `reported` topic (counted as a rejected report).
        report: bool,
    },
}

/// What `classify` checks a message against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestRules {
    pub budget: SpecBudget,
    /// The highest acceptable `seq` now (see `idem_protocol::limits::seq_ceiling`).
    pub seq_ceiling: u64,
}

/// Parses topic and payload. Pure: no state, no IO. `oversized` is the
/// original payload length when the MQTT adapter already dropped the payload
/// for being over the report limit.
pub fn classify(
    root: &TopicRoot,
    topic: &str,
    payload: &[u8],
    oversized: Option<usize>,
    rules: IngestRules,
) -> Inbound {
    let parsed = match root.parse(topic) {
        Ok(p) => p,
        Err(e) => {
            return Inbound::Rejected {
                reason: e.reason(),
                detail: e.to_string(),
                // `{root}/bad$id/reported` is still a report, if a bad one.
                report: topic.ends_with("/reported"),
            };
        }
    };
    let report_channel = parsed.channel == Channel::Reported;
    if let Some(len) = oversized {
        return Inbound::Rejected {
            reason: "oversized",
            detail: format!(
                "payload is {len} bytes; the limit is {}",
                rules.budget.max_report_bytes()
            ),
            report: report_channel,
        };
    }
    match parsed.channel {
        Channel::Reported => match Reported::decode_with_digest(payload, rules.budget) {
            Ok((report, _)) if report.seq > rules.seq_ceiling => Inbound::Rejected {
                reason: "seq_out_of_range",
                detail: format!(
                    "seq {} is more than a day ahead of the server's clock in Unix microseconds (at most {})",
                    report.seq, rules.seq_ceiling
                ),
                report: true,
            },
            Ok((report, digest)) => Inbound::Report {
                device: parsed.device,
                report,
                digest,
            },
            Err(e) => Inbound::Rejected {
                reason: e.reason(),
                detail: e.to_string(),
                report: true,
            },
        },
        Channel::Status if payload.is_empty() => Inbound::StatusCleared,
        Channel::Status => match Status::decode(payload) {
            Ok(status) => Inbound::Status {
                device: parsed.device,
                online: status == Status::Online,
            },
            Err(e) => Inbound::Rejected {
                reason: e.reason(),
                detail: e.to_string(),
                report: false,
            },
        },
        Channel::Desired | Channel::Get => Inbound::Rejected {
            reason: "unknown_channel",
            detail: format!("{} is a server-to-device topic", parsed.channel.as_str()),
            report: false,
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

/// The current seq ceiling from the wall clock.
fn current_rules(budget: SpecBudget) -> IngestRules {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    IngestRules {
        budget,
        seq_ceiling: seq_ceiling(micros),
    }
}

pub struct Ingest {
    pub pool: PgPool,
    pub fleet: Arc<FleetCache>,
    pub metrics: Arc<Metrics>,
    pub publisher: Publisher,
    pub engine: mpsc::Sender<EngineCommand>,
    pub root: TopicRoot,
    pub budget: SpecBudget,
    pub auto_register: bool,
    pub writer: Arc<DeviceWriter>,
    /// Set while batches fail to commit (read by `/readyz`).
    pub stall: Arc<Stall>,
    /// Raised when a write was held at least `recheck_after_stall`: the
    /// broker may have dropped what it could not deliver meanwhile.
    pub recheck: Arc<RecheckSignal>,
    pub recheck_after_stall: std::time::Duration,
}

/// A batch's accepted work, latest report per device.
#[derive(Default)]
struct Batch {
    reports: HashMap<DeviceId, (Reported, SpecDigest)>,
    online: HashMap<DeviceId, bool>,
}

/// How a write failed: worth retrying as is, or refused for its content.
enum WriteFailure {
    Transient(StoreError),
    Refused(StoreError),
}

impl Ingest {
    pub async fn run(self, mut inbound: IntakeReceiver, token: CancellationToken) {
        let mut messages = Vec::with_capacity(INGEST_BATCH);
        loop {
            let received = tokio::select! {
                () = token.cancelled() => break,
                n = inbound.recv_many(&mut messages, INGEST_BATCH) => n,
            };
            if received == 0 {
                break;
            }
            self.process(&messages, &token).await;
            messages.clear();
        }
    }

    async fn process(&self, messages: &[Received], token: &CancellationToken) {
        if self.names_a_device_the_cache_lacks(messages) {
            // Registered through another instance a moment ago, perhaps:
            // the cache catches up with the table before any is refused.
            if let Err(e) = self.writer.follow().await {
                tracing::debug!(error = %e, "could not catch up with other instances before judging unknown devices");
            }
        }
        let mut batch = self.sort(messages);
        // Connection changes, judged before the write mirrors them.
        let connectivity: Vec<(DeviceId, bool)> = batch
            .online
            .iter()
            .filter(|(device, online)| self.fleet.online(device) != Some(**online))
            .map(|(device, online)| (device.clone(), *online))
            .collect();
        let Some(refused) = self.store(&batch, token).await else {
            // Cancelled before the batch committed: leave the messages
            // unacknowledged so the broker delivers them again.
            return;
        };
        for device in &refused {
            batch.reports.remove(device);
        }
        let applied: Vec<DeviceId> = batch.reports.into_keys().collect();
        for received in messages {
            match &received.ack_via {
                AckVia::Server => self.publisher.ack(&received.publish),
                AckVia::Adopted(acks) => acks.ack(&received.publish),
            }
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

    /// Whether a message is from a device this cache does not hold.
    fn names_a_device_the_cache_lacks(&self, messages: &[Received]) -> bool {
        !self.auto_register
            && messages.iter().any(|received| {
                self.root
                    .parse(&received.publish.topic)
                    .is_ok_and(|topic| !self.fleet.contains(&topic.device))
            })
    }

    async fn tell_engine(&self, command: EngineCommand) {
        if self.engine.send(command).await.is_err() {
            tracing::debug!("engine stopped; stored reports get no follow-up now");
        }
    }

    /// Classifies every message and keeps the newest report per device.
    fn sort(&self, messages: &[Received]) -> Batch {
        let rules = current_rules(self.budget);
        let mut batch = Batch::default();
        for received in messages {
            let publish = &received.publish;
            match classify(
                &self.root,
                &publish.topic,
                &publish.payload,
                received.oversized,
                rules,
            ) {
                Inbound::Report {
                    device,
                    report,
                    digest,
                } => {
                    let Some(stored) = self.known_seq(&device) else {
                        self.metrics.reject_report("unknown_device");
                        tracing::debug!(%device, "report from an unregistered device refused");
                        continue;
                    };
                    let highest = batch.reports.get(&device).map(|(r, _)| r.seq).max(stored);
                    let verdict = seq_verdict(report.seq, highest);
                    self.metrics.report(verdict).increment(1);
                    match verdict {
                        ReportResult::Applied => {
                            if report.health == Some(Health::Unknown) {
                                self.metrics.health_unknown.increment(1);
                            }
                            batch.reports.insert(device, (report, digest));
                        }
                        ReportResult::Duplicate | ReportResult::Stale | ReportResult::Rejected => {}
                    }
                }
                Inbound::Status { device, online } => {
                    if self.fleet.contains(&device) {
                        batch.online.insert(device, online);
                    } else {
                        self.metrics.reject_message("unknown_device");
                    }
                }
                Inbound::StatusCleared => {}
                Inbound::Rejected {
                    reason,
                    detail,
                    report,
                } => {
                    if report {
                        self.metrics.reject_report(reason);
                    } else {
                        self.metrics.reject_message(reason);
                    }
                    tracing::debug!(topic = %publish.topic, reason, %detail, "inbound message refused");
                }
            }
        }
        batch
    }

    /// Where `report` differs from the device's desired spec, when it does
    /// (for the `drifted` event: paths only, bounded), leaving out the
    /// fields it owns.
    fn drift_of(
        fleet: &FleetCache,
        device: &DeviceId,
        report: &Reported,
        digest: SpecDigest,
        owned: Option<&OwnedFields>,
    ) -> Option<Arc<DriftPaths>> {
        let desired = fleet.desired(device)?;
        (desired.digest != digest).then(|| {
            Arc::new(match owned {
                // The paths of the specs as compared: without what it owns.
                Some(owned) => drift_paths(
                    &owned.strip(&report.spec),
                    &owned.strip(&desired.spec),
                    desired.digest,
                    |path| owned.covers(path),
                ),
                None => drift_paths(&report.spec, &desired.spec, desired.digest, |_| false),
            })
        })
    }

    /// `Some(highest seq)` for a device whose reports we accept.
    fn known_seq(&self, device: &DeviceId) -> Option<Option<u64>> {
        match self.fleet.reported_seq(device) {
            Some(seq) => Some(seq),
            None if self.auto_register => Some(None),
            None => None,
        }
    }

    /// Stores the batch, retrying transient failures until it commits and
    /// isolating reports the database refuses. Returns the devices whose
    /// report was dropped, or `None` if cancelled before everything committed.
    async fn store(&self, batch: &Batch, token: &CancellationToken) -> Option<Vec<DeviceId>> {
        if batch.reports.is_empty() && batch.online.is_empty() {
            return Some(Vec::new());
        }
        let rows: Vec<PendingReport<'_>> = batch
            .reports
            .iter()
            .map(|(device, (report, digest))| PendingReport {
                device: device.clone(),
                row: report_row(device, report, digest),
                state: ReportedState {
                    seq: report.seq,
                    digest: *digest,
                    generation: report.generation,
                    rejection: report
                        .error
                        .as_ref()
                        .map(|e| (e.generation, e.message.clone())),
                    // Recomputed under the writer for a device that owns
                    // fields (`write`).
                    drift: Self::drift_of(&self.fleet, device, report, *digest, None),
                },
                report,
                health: report.health,
            })
            .collect();
        let online: Vec<(DeviceId, bool)> =
            batch.online.iter().map(|(d, o)| (d.clone(), *o)).collect();
        let mut refused = Vec::new();
        // Report slices still to write; the connection state goes with the
        // first write that commits (alone, if every report was refused).
        let mut pending: Vec<&[PendingReport<'_>]> = vec![&rows];
        let mut online: &[(DeviceId, bool)] = &online;
        let mut backoff = Backoff::store_and_broker();
        loop {
            let slice = match pending.pop() {
                Some(slice) => slice,
                None if online.is_empty() => break,
                None => &[],
            };
            let started = Instant::now();
            self.stall.writing();
            match self.write(slice, online).await {
                Ok(()) => {
                    self.metrics
                        .db_batch_ingest
                        .record(started.elapsed().as_secs_f64());
                    if self
                        .stall
                        .progressed()
                        .is_some_and(|waited| waited >= self.recheck_after_stall)
                    {
                        self.recheck.raise(RecheckTrigger::IngestStalled);
                    }
                    online = &[];
                    backoff.reset();
                }
                Err(WriteFailure::Refused(e)) if slice.len() > 1 => {
                    tracing::warn!(error = %e, reports = slice.len(), "the database refused a report batch; splitting it to find the refused report");
                    self.metrics.ingest_batch_splits.increment(1);
                    let (first, second) = slice.split_at(slice.len() / 2);
                    pending.push(second);
                    pending.push(first);
                }
                Err(WriteFailure::Refused(e)) if slice.len() == 1 => {
                    let device = &slice[0].device;
                    self.metrics.reject_report("db_refused");
                    tracing::error!(%device, error = %e, "the database refused this device's report; it is dropped");
                    refused.push(device.clone());
                }
                // Without reports only the connection state was written:
                // nothing to isolate, so it is retried like a transient failure.
                Err(WriteFailure::Refused(e) | WriteFailure::Transient(e)) => {
                    let delay = backoff.next_delay();
                    tracing::error!(error = %e, "storing reports failed; retrying in {delay:?}");
                    tokio::select! {
                        () = token.cancelled() => return None,
                        () = tokio::time::sleep(delay) => {}
                    }
                    pending.push(slice);
                }
            }
        }
        Some(refused)
    }

    async fn write(
        &self,
        rows: &[PendingReport<'_>],
        online: &[(DeviceId, bool)],
    ) -> Result<(), WriteFailure> {
        let classify_failure = |e: StoreError| {
            if e.is_refused_data() {
                WriteFailure::Refused(e)
            } else {
                WriteFailure::Transient(e)
            }
        };
        let reports: Vec<&ReportRow> = rows.iter().map(|r| &r.row).collect();
        let mut write = self.writer.begin().await.map_err(WriteFailure::Transient)?;
        store::devices::apply_reports(&mut write, &reports, self.auto_register)
            .await
            .map_err(classify_failure)?;
        let online_rows: Vec<(String, bool)> =
            online.iter().map(|(d, o)| (d.to_string(), *o)).collect();
        store::devices::set_online(&mut write, &online_rows)
            .await
            .map_err(classify_failure)?;
        // Under the writer, the owned fields are those every committed
        // change (a new declaration, a relabelling) left: the digest the
        // cache compares leaves them out.
        // A device its first report registers (`--auto-register`) has no
        // labels: it owns the server-wide paths.
        let unlabelled = OnceCell::new();
        let mut reported = Vec::with_capacity(rows.len());
        for r in rows {
            let mut state = r.state.clone();
            let (owned, registered) = match write.cache().owned_if_known(&r.device) {
                Some(owned) => (owned, false),
                None => (
                    unlabelled
                        .get_or_init(|| write.cache().owned_set().unlabelled())
                        .clone(),
                    true,
                ),
            };
            if let Some(owned) = &owned {
                state.digest = owned.digest(&r.report.spec);
                state.drift = Self::drift_of(
                    write.cache(),
                    &r.device,
                    r.report,
                    state.digest,
                    Some(owned),
                );
            }
            let digest = state.digest;
            reported.push(FleetChange::Reported {
                id: r.device.clone(),
                reported: state,
                health: r.health,
            });
            if registered && owned.is_some() {
                reported.push(FleetChange::Owned {
                    id: r.device.clone(),
                    owned,
                    reported_digest: Some(digest),
                    retained_stale: false,
                });
            }
        }
        write.mirror(reported);
        write.mirror(
            online
                .iter()
                .map(|(device, online)| FleetChange::Online(device.clone(), *online)),
        );
        write
            .commit("committing reports")
            .await
            .map_err(classify_failure)?;
        Ok(())
    }
}

/// One report of a batch on its way to PostgreSQL.
struct PendingReport<'a> {
    device: DeviceId,
    row: ReportRow,
    /// What the cache holds once the row has committed (its digest and
    /// drift recomputed under the writer for a device that owns fields).
    state: ReportedState,
    report: &'a Reported,
    health: Option<Health>,
}

fn report_row(device: &DeviceId, report: &Reported, digest: &SpecDigest) -> ReportRow {
    ReportRow {
        id: device.clone(),
        seq: report.seq,
        spec: report.spec.clone(),
        digest: digest.to_string(),
        generation: report.generation,
        error_generation: report.error.as_ref().map(|e| e.generation),
        error: report.error.as_ref().map(|e| e.message.clone()),
        health: report.health,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> TopicRoot {
        TopicRoot::new("idem/v1").unwrap()
    }

    fn rules() -> IngestRules {
        IngestRules {
            budget: SpecBudget::new(1024),
            seq_ceiling: 1_000_000,
        }
    }

    fn classify_plain(topic: &str, payload: &[u8]) -> Inbound {
        classify(&root(), topic, payload, None, rules())
    }

    #[test]
    fn a_valid_report_is_classified_with_its_device() {
        let got = classify_plain("idem/v1/pump-1/reported", br#"{"seq":5,"spec":{"a":1}}"#);
        let Inbound::Report {
            device,
            report,
            digest,
        } = got
        else {
            panic!("expected a report, got {got:?}")
        };
        assert_eq!(device.as_str(), "pump-1");
        assert_eq!(report.seq, 5);
        assert_eq!(digest, SpecDigest::of(&serde_json::json!({"a": 1})));
    }

    #[test]
    fn bad_messages_are_rejected_with_a_reason() {
        let too_big = vec![b' '; rules().budget.max_report_bytes() + 1];
        let cases: [(&str, &[u8], &str, bool); 10] = [
            ("idem/v1/pump-1/reported", b"{oops", "malformed", true),
            ("idem/v1/pump-1/reported", &too_big, "oversized", true),
            (
                "idem/v1/$bad/reported",
                br#"{"seq":1,"spec":{}}"#,
                "invalid_device_id",
                true,
            ),
            ("idem/v1/pump-1/status", b"maybe", "invalid_status", false),
            ("idem/v1/pump-1/desired", b"{}", "unknown_channel", false),
            (
                "idem/v1/pump-1/reported",
                br#"{"seq":18446744073709551615,"spec":{}}"#,
                "malformed",
                true,
            ),
            (
                "idem/v1/pump-1/reported",
                br#"[5, null, {"a": 1}]"#,
                "malformed",
                true,
            ),
            (
                "idem/v1/pump-1/reported",
                br#"{"seq":1,"spec":{"x":"\u0000"}}"#,
                "nul_character",
                true,
            ),
            (
                "idem/v1/pump-1/reported",
                br#"{"seq":1000001,"spec":{}}"#,
                "seq_out_of_range",
                true,
            ),
            (
                "idem/v1/events/status",
                b"online",
                "invalid_device_id",
                false,
            ),
        ];
        for (topic, payload, expected, is_report) in cases {
            match classify_plain(topic, payload) {
                Inbound::Rejected { reason, report, .. } => {
                    assert_eq!((reason, report), (expected, is_report), "{topic}")
                }
                other @ (Inbound::Report { .. }
                | Inbound::Status { .. }
                | Inbound::StatusCleared) => {
                    panic!("{topic}: expected rejection, got {other:?}")
                }
            }
        }
    }

    #[test]
    fn a_payload_the_adapter_dropped_is_oversized_with_its_length() {
        let got = classify(
            &root(),
            "idem/v1/pump-1/reported",
            b"",
            Some(5_000_000),
            rules(),
        );
        let Inbound::Rejected {
            reason,
            detail,
            report,
        } = got
        else {
            panic!("expected a rejection, got {got:?}")
        };
        assert_eq!((reason, report), ("oversized", true));
        assert!(detail.contains("5000000"), "{detail}");
    }

    #[test]
    fn a_seq_at_the_ceiling_is_accepted() {
        let got = classify_plain("idem/v1/pump-1/reported", br#"{"seq":1000000,"spec":{}}"#);
        assert!(matches!(got, Inbound::Report { .. }), "{got:?}");
    }

    #[test]
    fn status_messages_carry_online_or_offline() {
        assert_eq!(
            classify_plain("idem/v1/d/status", b"offline"),
            Inbound::Status {
                device: DeviceId::parse("d").unwrap(),
                online: false
            }
        );
        assert_eq!(
            classify_plain("idem/v1/d/status", b""),
            Inbound::StatusCleared
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
