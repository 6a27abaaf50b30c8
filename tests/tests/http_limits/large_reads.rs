//! Large reads: a plan's device pages, whose field diffs over specs of
//! thousands of fields can be large, stop at their byte bound with a
//! cursor to go on, and many viewers reading them at once leave the
//! server's memory flat: each token reads two at a time, every caller
//! together four.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_device_sim::SimDevice;
use idem_protocol::DeviceId;
use idem_tests::{Scenario, ServerSettings};
use serde_json::{json, Map, Value};

/// The byte bound of a page (`server/src/http/large_reads.rs`).
const MAX_PAGE_BYTES: usize = 4 * 1024 * 1024;
const DEVICES: usize = 120;

/// A spec of `leaves` numeric fields, each `value`: ~9 bytes a field.
fn wide_spec(leaves: usize, value: u32) -> Value {
    let fields: Map<String, Value> = (0..leaves)
        .map(|i| (format!("k{i:04}"), json!(value)))
        .collect();
    json!({ "f": fields })
}

/// This process's resident memory (the server runs in it).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// `GET path` as raw text: status, `Retry-After`, body.
async fn get_raw(client: &idem_tests::ApiClient, path: &str) -> (u16, Option<String>, String) {
    let response = client
        .request(reqwest::Method::GET, path)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, retry_after, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_pages_stop_at_their_byte_bound_and_concurrent_viewers_leave_memory_flat() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let old = wide_spec(6_000, 1);
    let new = wide_spec(6_000, 2);
    let devices: Vec<SimDevice> = (0..DEVICES)
        .map(|i| {
            SimDevice::new(
                DeviceId::parse(&format!("wide-{i:03}")).unwrap(),
                old.clone(),
            )
        })
        .collect();
    scenario.register(&devices, &old).await.unwrap();
    let fleet = scenario.start_fleet(devices).await.unwrap();
    scenario
        .wait_reports_stored(DEVICES, Duration::from_secs(60))
        .await
        .unwrap();
    let (status, plan) = scenario
        .server
        .post("/v1/plans", &json!({"all": true, "spec": new}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{plan}");
    let plan_id = plan["plan_id"].as_str().unwrap().to_owned();
    let path = |after: Option<&str>| match after {
        Some(after) => format!("/v1/plans/{plan_id}/devices?limit=1000&after={after}"),
        None => format!("/v1/plans/{plan_id}/devices?limit=1000"),
    };

    // Every page under the bound (plus the one device that crosses it);
    // the pages together hold every device once.
    let mut seen = Vec::new();
    let mut pages = 0;
    let mut after: Option<String> = None;
    loop {
        let (status, _, body) = get_raw(&scenario.server, &path(after.as_deref())).await;
        assert_eq!(status, 200, "{}", &body[..body.len().min(300)]);
        assert!(
            body.len() < MAX_PAGE_BYTES + 1024 * 1024,
            "a page of {} bytes",
            body.len()
        );
        let page: Value = serde_json::from_str(&body).unwrap();
        let ids = page["devices"].as_array().unwrap();
        assert!(!ids.is_empty(), "a page holds one device at least");
        seen.extend(
            ids.iter()
                .map(|d| d["device_id"].as_str().unwrap().to_owned()),
        );
        pages += 1;
        match page["next_after"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!((seen.len(), unique.len()), (DEVICES, DEVICES));
    assert!(pages > 1, "{pages} page(s)");

    // Eight viewers, each reading the largest page three times, at once.
    let mut viewers = Vec::new();
    for i in 0..8 {
        viewers.push(
            scenario
                .server
                .client_for_role(&format!("wide-viewer-{i}"), "viewer")
                .await
                .unwrap(),
        );
    }
    let before = rss_bytes();
    let peak = Arc::new(AtomicU64::new(before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let first = path(None);
    let readers: Vec<_> = viewers
        .iter()
        .cloned()
        .map(|viewer| {
            let first = first.clone();
            tokio::spawn(async move {
                for _ in 0..3 {
                    let (status, _, body) = get_raw(&viewer, &first).await;
                    assert_eq!(status, 200, "{}", &body[..body.len().min(300)]);
                }
            })
        })
        .collect();
    for reader in readers {
        reader.await.unwrap();
    }
    sampling.store(false, Ordering::Relaxed);
    sampler.await.unwrap();
    let grown = peak.load(Ordering::Relaxed).saturating_sub(before);
    eprintln!(
        "{pages} pages; eight viewers reading at once: resident memory {} MiB before, \
         grown by at most {} MiB",
        before / (1024 * 1024),
        grown / (1024 * 1024)
    );
    assert!(
        grown < 200 * 1024 * 1024,
        "eight viewers reading at once grew the server's memory by {} MiB",
        grown / (1024 * 1024)
    );

    // One token reads two at a time: more at once are refused, saying
    // when to come back. Six reads sent together overlap only as far as the
    // machine runs them together: on a loaded machine a burst can be served
    // one after another, so up to five bursts are sent before concluding.
    let one = viewers[0].clone();
    let mut refused = 0;
    for _burst in 0..5 {
        let at_once: Vec<_> = (0..6)
            .map(|_| {
                let (one, first) = (one.clone(), first.clone());
                tokio::spawn(async move { get_raw(&one, &first).await })
            })
            .collect();
        for answer in at_once {
            let (status, retry_after, body) = answer.await.unwrap();
            match status {
                200 => {}
                429 => {
                    refused += 1;
                    assert_eq!(retry_after.as_deref(), Some("1"));
                    assert!(body.contains("too_many_large_reads"), "{body}");
                }
                other => panic!("answered {other}: {}", &body[..body.len().min(300)]),
            }
        }
        if refused > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    }
    assert!(
        refused > 0,
        "five bursts of six reads at once by one token were all served"
    );
    fleet.shutdown().await.unwrap();
}
