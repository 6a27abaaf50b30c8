//! Unit tests of the connection handling: the cap under the open-file
//! limit, peer groups and shares, the answers written outside hyper.

use std::time::Duration;

use axum::http::StatusCode;
use idem_protocol::api::ErrorCode;

use super::error_answers::RawError;
use super::hyper_head_errors::hyper_error_answer;
use super::limits::{cap_for_fd_limit, fit_peer_share};
use super::peers::PeerConnections;
use super::*;

#[test]
fn the_connection_cap_leaves_the_reserve_of_the_open_file_limit_free() {
    assert_eq!(cap_for_fd_limit(4_096, 1_048_576), 4_096);
    assert_eq!(cap_for_fd_limit(4_096, 1_024), 1_024 - 256);
    assert_eq!(cap_for_fd_limit(4_096, 4_352), 4_096);
    assert_eq!(cap_for_fd_limit(4_096, 4_351), 4_095);
}

#[test]
fn a_tiny_open_file_limit_still_allows_a_connection() {
    assert_eq!(cap_for_fd_limit(4_096, 300), 150);
    assert_eq!(cap_for_fd_limit(4_096, 1), 1);
    assert_eq!(cap_for_fd_limit(4_096, 0), 1);
}

#[test]
fn ipv6_clients_are_grouped_by_their_64_network_and_mapped_ipv4_by_its_address() {
    let group = |ip: &str| PeerGroup::of(ip.parse().unwrap());
    assert_eq!(group("2001:db8:1:2::1"), group("2001:db8:1:2:ffff::9"));
    assert_ne!(group("2001:db8:1:2::1"), group("2001:db8:1:3::1"));
    assert_eq!(group("::ffff:192.0.2.7"), group("192.0.2.7"));
    assert_ne!(group("192.0.2.7"), group("192.0.2.8"));
    assert_eq!(group("2001:db8:1:2::1").to_string(), "2001:db8:1:2::/64");
}

#[test]
fn an_address_gets_its_share_of_connections_and_a_closed_one_frees_its_place() {
    let peers = PeerConnections::new(2);
    let a = PeerGroup::of("127.0.0.3".parse().unwrap());
    let b = PeerGroup::of("127.0.0.4".parse().unwrap());
    let first = peers.try_admit(a).unwrap();
    let second = peers.try_admit(a).unwrap();
    assert!(peers.try_admit(a).is_none());
    assert!(peers.try_admit(b).is_some());
    drop(first);
    assert!(peers.try_admit(a).is_some());
    drop(second);
    assert!(
        peers.open.lock().unwrap().is_empty(),
        "no entry is kept for an address without connections"
    );
}

#[test]
fn the_peer_share_shrinks_with_a_lowered_connection_cap_and_never_exceeds_it() {
    assert_eq!(fit_peer_share(1_024, 4_096, 4_096), 1_024);
    assert_eq!(fit_peer_share(1_024, 4_096, 768), 192);
    assert_eq!(fit_peer_share(4_096, 4_096, 768), 768);
    assert_eq!(fit_peer_share(1, 4_096, 10), 1);
}

#[test]
fn hypers_empty_error_answers_are_recognised_and_the_apis_own_are_not() {
    let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\n\r\n";
    assert_eq!(
        hyper_error_answer(hyper_431),
        Some((HeadRejection::HeadersTooLarge, hyper_431.len()))
    );
    let hyper_400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n";
    assert_eq!(
        hyper_error_answer(hyper_400).map(|(r, _)| r),
        Some(HeadRejection::Malformed)
    );
    let ours = RawError {
        status: StatusCode::BAD_REQUEST,
        code: ErrorCode::InvalidJson,
        message: "x".to_owned(),
    }
    .to_http(None);
    assert_eq!(hyper_error_answer(&ours), None);
    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
    assert_eq!(hyper_error_answer(ok), None);
    assert_eq!(hyper_error_answer(b"HTTP/1.1 431 Request"), None);
}

#[test]
fn a_refusal_at_accept_is_a_json_error_with_retry_after_and_connection_close() {
    let limits = HttpLimits {
        max_connections: 40,
        max_connections_per_peer: 10,
        header_timeout: Duration::from_millis(1_500),
        body_timeout: Duration::from_secs(1),
        max_body_bytes: 1_024,
    };
    let answer = String::from_utf8(ConnectionRefusal::PerPeer.answer(&limits)).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.1 429 Too Many Requests\r\n"),
        "{head}"
    );
    assert!(head.contains("\r\nretry-after: 2\r\n"), "{head}");
    assert!(head.contains("\r\nconnection: close"), "{head}");
    assert!(
        head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
        "{head}"
    );
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["error"]["code"], "too_many_connections_from_peer");
    let answer = ConnectionRefusal::MaxConnections.answer(&limits);
    assert!(answer.starts_with(b"HTTP/1.1 503 Service Unavailable\r\n"));
}

#[test]
fn rejection_codes_round_trip() {
    for rejection in BodyRejection::ALL {
        assert_eq!(BodyRejection::from_code(rejection.code()), Some(rejection));
    }
    assert_eq!(BodyRejection::from_code(0), None);
}
