-- The other instances' caches follow device writes through a log of
-- transactions instead of a version on every row: per-row versions cost
-- every device update a sequence call, a trigger and an index entry (twice
-- the time of a 100,000-row report batch). Each device-writing transaction
-- that changed what the fleet cache holds appends one row naming its
-- devices; versions are handed out under the device-writes advisory lock
-- (`server/src/store/writer.rs`), so they commit in order without gaps.
DROP TRIGGER devices_changed ON devices;
DROP FUNCTION idem_devices_changed();
DROP TRIGGER device_removed ON devices;
DROP FUNCTION idem_device_removed();
DROP TRIGGER device_versioned ON devices;
DROP FUNCTION idem_device_versioned();
DROP FUNCTION idem_begin_device_write(bigint, uuid);
DROP FUNCTION idem_device_versions_high();
DROP FUNCTION idem_device_writer();
DROP TABLE device_removals;
DROP INDEX devices_by_version;
ALTER TABLE devices DROP COLUMN version, DROP COLUMN written_by;
DROP SEQUENCE device_versions;

CREATE TABLE device_changes (
    version  bigint      PRIMARY KEY,
    -- The writing process (`DeviceWriter`'s id): it never reads its own.
    writer   uuid        NOT NULL,
    -- The devices whose rows it changed; NULL: every device (a new
    -- declaration of owned fields).
    ids      text[],
    -- Only the engine's columns changed (status, attempts, outcome,
    -- retained generation): a follower reads those alone.
    engine_only boolean NOT NULL DEFAULT false,
    at       timestamptz NOT NULL DEFAULT now()
);

-- The start of every device-writing transaction, in one round trip: the
-- device-writes lock, then the last version (with the lock held, every
-- version up to it is committed and no other is being written).
CREATE FUNCTION idem_begin_device_write(lock_key bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(lock_key);
    RETURN coalesce((SELECT max(version) FROM device_changes), 0);
END
$$;
