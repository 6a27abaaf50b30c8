-- The hold on desired changes goes back inside a transaction, still in one
-- round trip (`BEGIN` and this call sent together): a transaction-level
-- lock ends with the session of a paused holder once it has been idle in
-- its transaction past `idle_in_transaction_session_timeout` (the pool
-- sets it to the instance lease), where a session-level lock would be
-- held until the process resumed (`server/src/store/writer.rs`).
DROP FUNCTION idem_hold_desired(bigint);

CREATE FUNCTION idem_hold_desired(lock_key bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(lock_key);
    -- A new snapshot: after any exclusive holder committed.
    RETURN coalesce((SELECT max(version) FROM device_changes
                     WHERE NOT (engine_only OR reports_only)), 0);
END
$$;
