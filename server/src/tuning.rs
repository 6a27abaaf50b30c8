//! The timing and sizing of the server in one place: how often each loop
//! looks, how long each wait lasts, how much each batch and channel holds,
//! each with its reason. What an operator should set is a flag
//! (`crate::config`); the bounds on input live with the input they bound
//! (`http/input.rs`, `idem_protocol::limits`). Only `std` here, so the
//! pure core may read these too (`scripts/core-check`).

use std::time::Duration;

// The engine and its state machine: how often results are written, how far pushes run ahead, how they are paced.

/// Results are written at least this often while there are any.
/// (Used in `reconcile/machine/mod.rs`.)
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(20);
/// Write at once when this many outcomes are waiting; a larger run is
/// started in slices of this size, bounding memory per write.
/// (Used in `reconcile/machine/mod.rs`.)
pub const FLUSH_SIZE: usize = 10_000;
/// Rollout pushes written ahead in one record, at most: a wave's first
/// pushes go out after a short write, and the rest follow in chunks while
/// those are answered, instead of all waiting for one long write.
/// (Used in `reconcile/machine/mod.rs`.)
pub const WRITE_AHEAD_CHUNK: usize = 512;
/// How often in-flight attempts are checked against deadlines and retry times.
/// (Used in `reconcile/machine/mod.rs`.)
pub const SCAN_INTERVAL: Duration = Duration::from_millis(50);
/// Pacing headroom: pushes are spaced `1.1 s / rate` apart and at most
/// `rate` leave in any 1.1 s, so that delivery jitter of up to 100 ms between
/// server and devices never shows more than `rate` in a one-second window.
/// The price: a sustained push stream runs at about 91 % of the limit.
/// (Used in `reconcile/pacer.rs`.)
pub const PACING_WINDOW: Duration = Duration::from_millis(1_100);
/// A late wake-up (e.g. after a database write) may catch up on at most this
/// much pacing time at once; the sliding window still bounds any burst.
/// (Used in `reconcile/pacer.rs`.)
pub const PACING_CATCH_UP: Duration = Duration::from_millis(10);
/// Most commands handled before the machine's effects are carried out.
/// (Used in `engine/mod.rs`.)
pub const ENGINE_COMMANDS_PER_BATCH: usize = 256;
/// Catch-ups tried before a batch of publishes leaves without a hold on
/// desired changes (other instances changing desired state faster than the
/// cache follows): each try that finds the cache behind catches up first.
/// (Used in `engine/sends.rs`.)
pub const DESIRED_HOLD_TRIES: usize = 3;
/// Rechecks start at most this often; signs meanwhile join the next one
/// (which asks only the devices not heard from since it began).
/// (Used in `engine/recheck.rs`.)
pub const RECHECK_COOLDOWN: Duration = Duration::from_secs(5);
/// Retained statuses re-read per step; steps are paced at the recheck's
/// rate, so the broker's burst of retained messages stays within its queue.
/// (Used in `engine/recheck.rs`.)
pub const STATUS_REREAD_CHUNK: usize = 100;

// Several instances: how fast a lease is taken, a run taken up, an operator's rollout action carried over, a dead instance's session drained, the change log followed.

/// How often an instance without the lease tries to take it.
/// (Used in `engine/seat.rs`.)
pub const ENGINE_LEASE_TRY_EVERY: Duration = Duration::from_millis(250);
/// How often the holder looks for runs other instances committed.
/// (Used in `engine/seat.rs`.)
pub const TAKE_UP_EVERY: Duration = Duration::from_millis(500);
/// How often the holder forgets the runs it carried that the database has
/// as completed (they are never taken up again), so that the set of runs it
/// carries holds only unfinished ones.
/// (Used in `engine/seat.rs`.)
pub const FORGET_COMPLETED_EVERY: Duration = Duration::from_secs(60);
/// Runs found and not yet handed to the engine.
/// (Used in `engine/seat.rs`.)
pub const TAKE_UPS_CAPACITY: usize = 64;
/// How often the holder looks for rollout actions other instances asked for.
/// (Used in `engine/seat.rs`.)
pub const ASKED_ACTIONS_EVERY: Duration = Duration::from_millis(100);
/// How long an action asked of the engine's holder through the database
/// waits to be claimed (the holder looks every `ASKED_ACTIONS_EVERY`).
/// (Used in `http/api/rollouts.rs`.)
pub const HOLDER_CLAIMS_WITHIN: Duration = Duration::from_secs(10);
/// How long a claimed action waits to be answered: the holder writes what
/// the action did before it answers.
/// (Used in `http/api/rollouts.rs`.)
pub const HOLDER_ANSWERS_WITHIN: Duration = Duration::from_secs(10);
/// How often the answer is looked for.
/// (Used in `http/api/rollouts.rs`.)
pub const HOLDER_ANSWER_POLL: Duration = Duration::from_millis(50);
/// How often a start waits between claims while a holder may be stale.
/// (Used in `app/instance.rs`.)
pub const INSTANCE_CLAIM_RETRY: Duration = Duration::from_millis(250);
/// Never looks more often than this.
/// (Used in `app/session_drains.rs`.)
pub const SESSION_DRAIN_MIN_LOOK_EVERY: Duration = Duration::from_millis(250);
/// Nothing delivered for this long (and everything acknowledged): the
/// session's queue is empty.
/// (Used in `mqtt/adopt.rs`.)
pub const DRAIN_QUIET: Duration = Duration::from_secs(1);
/// A drain that has not ended by then gives up (the session keeps the rest,
/// and the instance's claim goes stale again for another try).
/// (Used in `mqtt/adopt.rs`.)
pub const DRAIN_LIMIT: Duration = Duration::from_secs(120);
/// How often the drain looks at the time while the connection is silent.
/// (Used in `mqtt/adopt.rs`.)
pub const DRAIN_TICK: Duration = Duration::from_millis(100);
/// Requests the drain's client may queue (acknowledgements, mostly).
/// (Used in `mqtt/adopt.rs`.)
pub const DRAIN_REQUESTS: usize = 1_000;
/// The change log keeps this much (an instance that did not look for
/// longer reloads every device).
/// (Used in `store/follow.rs`.)
pub const CHANGE_LOG_KEPT: Duration = Duration::from_secs(600);
/// Pruning of the change log runs every this many catch-ups.
/// (Used in `store/follow.rs`.)
pub const CHANGE_LOG_PRUNE_EVERY: u32 = 60;

// MQTT, the ingest and the broker's accounts.

/// Requests the client may queue before `publish` waits for the event loop.
/// (Used in `mqtt/mod.rs`.)
pub const MQTT_REQUEST_CHANNEL_CAPACITY: usize = 10_000;
/// A reconnect after being away this long starts a recheck even when the
/// broker kept the session: its queue may have filled meanwhile.
/// (Used in `mqtt/mod.rs`.)
pub const MQTT_LONG_ABSENCE: Duration = Duration::from_secs(30);
/// How often an unchanged connect failure is logged at error level again.
/// (Used in `mqtt/mod.rs`.)
pub const MQTT_REPEAT_CONNECT_ERROR: Duration = Duration::from_secs(60);
/// Most messages stored in one database batch.
/// (Used in `ingest/mod.rs`.)
pub const INGEST_BATCH: usize = 4_096;
/// How long the plugin has to answer one batch.
/// (Used in `broker/dynsec.rs`.)
pub const DYNSEC_ANSWER_TIMEOUT: Duration = Duration::from_secs(15);
/// Commands sent in one message.
/// (Used in `broker/dynsec.rs`.)
pub const DYNSEC_COMMANDS_PER_BATCH: usize = 400;

// Events: the relay to MQTT and the live stream (SSE).

/// Events the relay reads and publishes at once; it saves its cursor after
/// each batch, so a relay killed between the two leaves its successor at
/// most this many to publish again (consumers de-duplicate by `id`).
/// (Used in `events/relay.rs`.)
pub const RELAY_READ_BATCH: i64 = 2_000;
/// How long a published batch waits for the broker's PUBACKs before it is
/// published again.
/// (Used in `events/relay.rs`.)
pub const RELAY_ACKED_WITHIN: Duration = Duration::from_secs(10);
/// Fallback poll when no commit woke the relay (e.g. another instance wrote).
/// (Used in `events/relay.rs`.)
pub const RELAY_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// How often the relay's holder prunes the event log past its retention.
/// (Used in `events/relay.rs`.)
pub const RELAY_PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// Targets of a run decided `already_converged` at its creation that share
/// one stored record, and their outcome events one entry of the event log:
/// a converged fleet of 100,000 costs about a hundred rows of each per run,
/// and a reader expands at most this many events from one entry.
/// (Used in `store/runs.rs`, `store/events.rs`, `events/log.rs`.)
pub const CONVERGED_SLICE: usize = 1_024;
/// Event-log entries of converged outcomes one read takes at most when no
/// device filter narrows them to one event each (each expands to up to
/// `CONVERGED_SLICE` events; a read that needs more reads again).
/// (Used in `events/log.rs`.)
pub const CONVERGED_SLICES_PER_READ: i64 = 4;
/// Most events one replay query reads (fewer at low replay rates, so that a
/// page is sent within about a quarter of a second).
/// (Used in `http/sse/mod.rs`.)
pub const SSE_REPLAY_PAGE: i64 = 500;
/// A comment line on an idle stream this often, so that proxies and load
/// balancers that close silent connections keep it open.
/// (Used in `http/sse/mod.rs`.)
pub const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);
/// `Retry-After` of a refused stream: streams last long, so a slot frees
/// up at no predictable time; this keeps retries cheap and spaced.
/// (Used in `http/sse/mod.rs`.)
pub const SSE_REFUSED_RETRY_AFTER: Duration = Duration::from_secs(5);
/// Replay pacing forgives this much lateness: after a pause the client gets
/// at most this many seconds' worth of events in a burst.
/// (Used in `http/sse/feeder.rs`.)
pub const SSE_PACING_SLACK: Duration = Duration::from_millis(20);
/// How long a dropped client has to read its final `dropped` event before
/// its connection is closed.
/// (Used in `http/sse/feeder.rs`.)
pub const SSE_DROP_GRACE: Duration = Duration::from_secs(2);

// HTTP connections and large reads.

/// How long in-flight requests may still run once shutdown begins.
/// (Used in `http/connections/mod.rs`.)
pub const HTTP_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Pause after an accept error that is not about one connection (e.g. the
/// process is out of file descriptors), so the loop never spins.
/// (Used in `http/connections/mod.rs`.)
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// How long a connection whose request head was refused is still read
/// (and what it sends discarded) after the answer, so that closing it does
/// not reset it before the client has read the answer.
/// (Used in `http/connections/hyper_head_errors.rs`.)
pub const REFUSED_HEAD_LINGER: Duration = Duration::from_secs(2);
/// How long a large read waits for a turn among [`AT_ONCE`].
/// (Used in `http/large_reads.rs`.)
pub const LARGE_READ_WAIT: Duration = Duration::from_secs(10);

// The channels between tasks, and housekeeping.

/// Commands queued for the engine (reports heard, desired changes, ticks
/// from other tasks); a sender waits while it is full, so it bounds memory.
/// (Used in `app/mod.rs`.)
pub const ENGINE_CAPACITY: usize = 1_024;
/// Run requests from API calls waiting for the engine (each caller waits
/// for its answer, so this bounds only how many wait at once).
/// (Used in `app/mod.rs`.)
pub const RUN_REQUESTS_CAPACITY: usize = 256;
/// Live events buffered per SSE subscriber before it must catch up from the log.
/// (Used in `app/mod.rs`.)
pub const LIVE_EVENTS_CAPACITY: usize = 16_384;
/// How often expired exemptions are looked for.
/// (Used in `ops/exemptions.rs`.)
pub const EXEMPTION_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// How often the limits are enforced.
/// (Used in `ops/retention.rs`.)
pub const RETENTION_PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// Runs deleted per statement.
/// (Used in `ops/retention.rs`.)
pub const RETENTION_RUN_BATCH: i64 = 50;
/// Encoded rows are sent to PostgreSQL in chunks of about this size, so it
/// parses one chunk while the next is encoded.
/// (Used in `store/copy.rs`.)
pub const COPY_CHUNK_BYTES: usize = 256 * 1024;
