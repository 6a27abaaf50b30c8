-- Publishes of desired state leave on fresh data. The engine's holder
-- hands each batch of pushes to the broker while it holds this lock
-- shared (`idem_hold_desired`, in a transaction whose `BEGIN` is sent with
-- the call: one round trip), and every device-writing transaction that
-- changes what a push carries (not only the engine's columns, not only
-- reports) takes it exclusive before it commits
-- (`server/src/store/writer.rs`): such a change commits either before the
-- batch was checked against it or after the batch left. A transaction
-- lock, so a paused holder's session ends after the pool's
-- `idle_in_transaction_session_timeout` (the instance lease).
CREATE INDEX device_changes_desired ON device_changes (version)
    WHERE NOT (engine_only OR reports_only);

-- Takes the lock shared, then (a new snapshot, after any exclusive holder
-- committed) reads the last version that changed what a push carries.
CREATE FUNCTION idem_hold_desired(lock_key bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(lock_key);
    RETURN coalesce((SELECT max(version) FROM device_changes
                     WHERE NOT (engine_only OR reports_only)), 0);
END
$$;
