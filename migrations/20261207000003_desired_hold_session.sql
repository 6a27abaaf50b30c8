-- The hold on desired changes in one round trip: a session-level lock
-- taken shared on a pooled connection, without a transaction around it
-- (the engine's holder takes one per batch of publishes). Released by
-- `pg_advisory_unlock_shared`, or by the end of the session when the
-- connection is closed instead (`server/src/store/writer.rs`).
DROP FUNCTION idem_hold_desired(bigint);

CREATE FUNCTION idem_hold_desired(lock_key bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock_shared(lock_key);
    -- A new snapshot: after any exclusive holder committed.
    RETURN coalesce((SELECT max(version) FROM device_changes
                     WHERE NOT (engine_only OR reports_only)), 0);
END
$$;
