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
