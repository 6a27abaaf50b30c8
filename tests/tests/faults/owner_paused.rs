//! Two instances on one broker and one database, 2,000 devices that all need
//! a push and answer it at once; the instance carrying the run is paused
//! (SIGSTOP) just after the run starts and resumed (SIGCONT) past its lease,
//! once the other instance has taken the engine over. The run's outcomes
//! are the truth, exactly: every device provisioned, none already converged,
//! none failed. (While paused mid-transaction it held the device-writes
//! lock and a share lock on its lease: PostgreSQL ends such a session after
//! a lease idle, so the takeover goes on.)

use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use serde_json::{json, Value};

use crate::{holder_of, owns, private_services, register, start_fleet, start_servers, SERIAL};

const DEVICES: usize = 2_000;
const LEASE: Duration = Duration::from_secs(3);
/// Past the lease by a margin: the other instance has taken over by then.
const PAUSED: Duration = Duration::from_secs(7);

/// Resumes a paused process when dropped, so that a failing test never
/// leaves one stopped (its own guard then ends it).
struct Paused(u32);

impl Paused {
    fn pause(pid: u32) -> Self {
        signal(pid, "-STOP");
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

fn signal(pid: u32, which: &str) {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill {which} {pid} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_owner_paused_past_its_lease_changes_no_outcome_of_its_run() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-paused").await;
    let group = format!("paused{tag}");
    let lease = format!("{}ms", LEASE.as_millis());
    let env = [
        ("IDEM_SHARE_GROUP", group.as_str()),
        ("IDEM_INSTANCE_LEASE", lease.as_str()),
        ("IDEM_PUSH_TIMEOUT", "20s"),
    ];
    let servers = start_servers(&["a", "b"], (&broker, &db, &tag, &root), &env).await;
    let plan = FleetPlan::new("paused-", DEVICES)
        .apply_latency(Duration::ZERO, Duration::ZERO)
        .seed(46)
        .build()
        .unwrap();
    register(&servers[0], &plan).await;
    let _fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    crate::wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(60)).await;
    let owner = holder_of(&servers, "engine", Duration::from_secs(15)).await;
    let other = 1 - owner;

    let mut v2 = plan.desired_spec.clone();
    v2["fleet_change"] = json!("paused-v2");
    // Posted to the owner, so that it carries the run from its first push
    // (a run posted elsewhere waits up to half a second to be taken up).
    let (status, body) = servers[owner]
        .post("/v1/desired", &json!({"all": true, "spec": v2}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let run_id = body["run_id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let pid = servers[owner].pid().unwrap();
    let paused = Paused::pause(pid);
    let paused_at = Instant::now();
    let deadline = paused_at + PAUSED + Duration::from_secs(10);
    while !owns(&servers[other], "engine").await {
        assert!(
            Instant::now() < deadline,
            "the other instance did not take the engine over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(PAUSED.saturating_sub(paused_at.elapsed())).await;
    drop(paused);

    let deadline = Instant::now() + Duration::from_secs(60);
    let run: Value = loop {
        let (_, run) = servers[other]
            .get(&format!("/v1/runs/{run_id}"))
            .await
            .unwrap();
        if run["state"] == "completed" {
            break run;
        }
        assert!(Instant::now() < deadline, "the run did not complete: {run}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let counts = &run["counts"];
    assert_eq!(counts["already_converged"], 0, "{run}");
    assert_eq!(counts["provisioned"], DEVICES, "{run}");
    assert_eq!(counts["failed"], 0, "{run}");
    assert_eq!(run["target_count"], DEVICES, "{run}");
}
