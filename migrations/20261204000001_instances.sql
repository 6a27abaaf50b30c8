-- The instance names in use (IDEM_INSTANCE / --instance): one row per live
-- server process, claimed at start-up, kept by a heartbeat and deleted at a
-- graceful stop. A claim whose heartbeat is older than the holder's lease
-- bound is stale and may be taken over by a new process of that name.
CREATE TABLE instances (
    name          text        PRIMARY KEY,
    holder        uuid        NOT NULL,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    lease_ms      bigint      NOT NULL CHECK (lease_ms > 0)
);

-- Work that exactly one instance may do at a time (`relay`: publishing the
-- event log to MQTT), held by the instance that renewed it last. `epoch`
-- grows by one each time the lease changes hands: a write fenced by a lease
-- checks holder and epoch in its own statement, so a former holder that was
-- paused past its lease cannot commit.
CREATE TABLE leases (
    name        text        PRIMARY KEY,
    holder      text        NOT NULL,
    holder_id   uuid        NOT NULL,
    epoch       bigint      NOT NULL,
    renewed_at  timestamptz NOT NULL,
    ttl_ms      bigint      NOT NULL CHECK (ttl_ms > 0)
);
