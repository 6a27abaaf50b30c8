-- Every change to a device row gets the next `version` (one sequence for
-- rows and removals) and the id of the process that wrote it
-- (`idem.writer`, set by the device writer in each transaction): another
-- instance's fleet cache follows the table by reading what others wrote
-- after the last version it saw. Device writes hold one advisory lock
-- (`server/src/store/writer.rs`), so versions commit in order.
CREATE SEQUENCE device_versions;

ALTER TABLE devices
    ADD COLUMN version bigint NOT NULL DEFAULT nextval('device_versions'),
    ADD COLUMN written_by uuid;
CREATE INDEX devices_by_version ON devices (version);

-- Deleted devices, for the caches of the other instances; pruned after a day.
CREATE TABLE device_removals (
    version     bigint      PRIMARY KEY DEFAULT nextval('device_versions'),
    id          text        NOT NULL,
    written_by  uuid,
    removed_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION idem_device_writer() RETURNS uuid LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('idem.writer', true), '')::uuid
$$;

CREATE FUNCTION idem_device_versioned() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.version := nextval('device_versions');
    NEW.written_by := idem_device_writer();
    RETURN NEW;
END
$$;
CREATE TRIGGER device_versioned BEFORE INSERT OR UPDATE ON devices
    FOR EACH ROW EXECUTE FUNCTION idem_device_versioned();

CREATE FUNCTION idem_device_removed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO device_removals (id, written_by) VALUES (OLD.id, idem_device_writer());
    RETURN NULL;
END
$$;
CREATE TRIGGER device_removed AFTER DELETE ON devices
    FOR EACH ROW EXECUTE FUNCTION idem_device_removed();

-- One notification per statement, naming the writer (a listener skips its own).
CREATE FUNCTION idem_devices_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_devices', coalesce(idem_device_writer()::text, ''));
    RETURN NULL;
END
$$;
CREATE TRIGGER devices_changed AFTER INSERT OR UPDATE OR DELETE ON devices
    FOR EACH STATEMENT EXECUTE FUNCTION idem_devices_changed();

-- The highest version handed out so far (0 before the first).
CREATE FUNCTION idem_device_versions_high() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM device_versions
$$;

-- The start of every device-writing transaction, in one round trip: the
-- device-writes lock, the writer's id for the triggers, and the highest
-- version (with the lock held, every version up to it is committed).
CREATE FUNCTION idem_begin_device_write(lock_key bigint, writer uuid) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(lock_key);
    PERFORM set_config('idem.writer', writer::text, true);
    RETURN idem_device_versions_high();
END
$$;
