//! Cost of metrics on the ingest hot path: classifying reports (topic +
//! payload decode + seq verdict) with and without the Prometheus counter
//! updates the server makes per message, measured in the same run.
//!
//! `cargo bench -p idem-server --bench ingest_metrics`

use std::hint::black_box;
use std::time::{Duration, Instant};

use idem_protocol::{Generation, Reported, SpecBudget, TopicRoot, MAX_COUNTER};
use idem_server::ingest::{classify, seq_verdict, Inbound, IngestRules};
use idem_server::ops::metrics::Metrics;
use serde_json::json;

const MESSAGES: usize = 200_000;
const ROUNDS: usize = 5;

fn main() {
    let root = TopicRoot::default();
    let messages: Vec<(String, Vec<u8>)> = (0..MESSAGES)
        .map(|i| {
            let report = Reported {
                seq: i as u64 + 1,
                generation: Some(Generation(1)),
                spec: json!({"firmware": "1.4.2", "sample_rate_hz": 10, "site": format!("s{}", i % 50)}),
                health: None,
                error: None,
            };
            (format!("idem/v1/dev-{:05}/reported", i % 10_000), report.encode())
        })
        .collect();
    let metrics = Metrics::new();

    let mut without = Vec::new();
    let mut with = Vec::new();
    for _ in 0..ROUNDS {
        without.push(time(|| run(&root, &messages, None)));
        with.push(time(|| run(&root, &messages, Some(&metrics))));
    }
    let best = |v: &[Duration]| v.iter().min().copied().unwrap_or_default();
    let rate = |d: Duration| MESSAGES as f64 / d.as_secs_f64();
    let (a, b) = (rate(best(&without)), rate(best(&with)));
    println!("ingest classification, {MESSAGES} reports, best of {ROUNDS}:");
    println!("  without metrics: {a:>12.0} reports/s");
    println!("  with metrics:    {b:>12.0} reports/s");
    println!("  ratio (with / without): {:.3}", b / a);
}

fn time(f: impl FnOnce()) -> Duration {
    let started = Instant::now();
    f();
    started.elapsed()
}

fn run(root: &TopicRoot, messages: &[(String, Vec<u8>)], metrics: Option<&Metrics>) {
    for (topic, payload) in messages {
        let rules = IngestRules {
            budget: SpecBudget::default(),
            seq_ceiling: MAX_COUNTER,
        };
        match classify(root, topic, payload, None, rules) {
            Inbound::Report { report, .. } => {
                let verdict = seq_verdict(report.seq, Some(report.seq.saturating_sub(1)));
                if let Some(m) = metrics {
                    m.report(verdict).increment(1);
                }
                black_box(report);
            }
            Inbound::Status { .. } | Inbound::StatusCleared | Inbound::Rejected { .. } => {
                if let Some(m) = metrics {
                    m.reject_report("malformed");
                }
            }
        }
    }
}
