//! Unit tests of the metrics: every series exposed at 0 with its help
//! text, and what a refused report or message counts.

use idem_protocol::OutcomeKind;

use super::*;

#[test]
fn every_outcome_series_is_exposed_at_zero_before_any_run() {
    let metrics = Metrics::new();
    let text = metrics.render();
    for kind in OutcomeKind::ALL {
        let line = format!(
            "idem_device_outcomes_total{{outcome=\"{}\"}} 0",
            kind.as_str()
        );
        assert!(text.contains(&line), "missing {line} in\n{text}");
    }
    assert!(text.contains("idem_reports_total{result=\"duplicate\"} 0"));
}

#[test]
fn every_exposed_family_has_its_help_text() {
    let text = Metrics::new().render();
    let typed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    assert_eq!(typed.len(), 53, "{text}");
    for name in typed {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("# HELP {name} ")) && l.len() > name.len() + 8),
            "no help text for {name} in\n{text}"
        );
    }
    assert!(text.contains("# TYPE idem_run_duration_seconds histogram"));
}

#[test]
fn http_and_sse_series_are_exposed_at_zero_with_every_reason() {
    let text = Metrics::new().render();
    for line in [
        "idem_http_connections 0",
        "idem_http_connections_refused_total{reason=\"max_connections\"} 0",
        "idem_http_connections_refused_total{reason=\"max_connections_per_peer\"} 0",
        "idem_http_requests_rejected_total{reason=\"body_too_large\"} 0",
        "idem_http_requests_rejected_total{reason=\"body_timeout\"} 0",
        "idem_http_requests_rejected_total{reason=\"uri_too_long\"} 0",
        "idem_http_requests_rejected_total{reason=\"headers_too_large\"} 0",
        "idem_http_requests_rejected_total{reason=\"malformed_request\"} 0",
        "idem_sse_clients 0",
        "idem_sse_clients_refused_total{reason=\"max_clients\"} 0",
        "idem_sse_clients_refused_total{reason=\"admin_reserve\"} 0",
        "idem_sse_clients_refused_total{reason=\"per_token\"} 0",
        "idem_sse_clients_dropped_total{reason=\"send_timeout\"} 0",
        "idem_sse_clients_dropped_total{reason=\"lagged\"} 0",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

#[test]
fn a_rejected_report_counts_both_the_result_and_the_reason() {
    let metrics = Metrics::new();
    metrics.reject_report("oversized");
    let text = metrics.render();
    assert!(
        text.contains("idem_reports_total{result=\"rejected\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("idem_reports_rejected_total{reason=\"oversized\"} 1"),
        "{text}"
    );
}

#[test]
fn a_refused_status_message_is_not_counted_as_a_report() {
    let metrics = Metrics::new();
    metrics.reject_message("invalid_status");
    let text = metrics.render();
    assert!(
        text.contains("idem_reports_total{result=\"rejected\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("idem_reports_rejected_total{reason=\"invalid_status\"} 1"),
        "{text}"
    );
}

#[test]
fn every_series_of_an_instance_carries_its_name_as_the_instance_label() {
    let metrics = Metrics::for_instance("edge-2");
    metrics.pushes.increment(3);
    metrics.run_duration.record(0.2);
    let text = metrics.render();
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    assert!(samples.len() > 100, "{text}");
    for line in &samples {
        assert!(
            line.contains("instance=\"edge-2\""),
            "no instance label: {line}"
        );
    }
    assert!(
        samples
            .iter()
            .any(|l| l.starts_with("idem_pushes_total{") && l.ends_with(" 3")),
        "{text}"
    );
}
