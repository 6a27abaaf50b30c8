-- A converged device is the common case: a run over a fleet where nothing
-- changed decides almost every target `already_converged` the moment it is
-- created. Those targets and their outcome events are stored in slices of
-- up to a thousand devices each, one row per slice, instead of one
-- `run_targets` row and one `events` row per device. Every reader expands
-- them into exactly what a row would have said (`server/src/store/runs.rs`,
-- `server/src/events/log.rs`).

-- The targets of a run decided `already_converged` when it was created.
-- Element i of the three arrays is one target; `last_device` is the
-- greatest of `device_ids` (computed by the insert, in the database's own
-- collation, so pages by device id can skip a slice).
CREATE TABLE run_converged (
    run_id       uuid        NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    slice        integer     NOT NULL,
    last_device  text        NOT NULL,
    device_ids   text[]      NOT NULL,
    generations  bigint[]    NOT NULL,
    -- elements may be null: a device that reported no health
    health       text[]      NOT NULL,
    decided_at   timestamptz NOT NULL,
    PRIMARY KEY (run_id, slice),
    CONSTRAINT run_converged_same_lengths CHECK (
        cardinality(device_ids) > 0
        AND cardinality(generations) = cardinality(device_ids)
        AND cardinality(health) = cardinality(device_ids))
);

-- Every target's outcome, one row per target, whichever way it is stored.
CREATE VIEW run_outcomes AS
    SELECT run_id, device_id, outcome, reason, generation, health, decided_at, wave, differed
    FROM run_targets
    UNION ALL
    SELECT c.run_id, u.device_id, 'already_converged', NULL, u.generation, u.health,
           c.decided_at, NULL, false
    FROM run_converged c,
         unnest(c.device_ids, c.generations, c.health) AS u (device_id, generation, health);

-- The `already_converged` CloudEvents of one run slice: one entry covering
-- the contiguous sequence numbers first_sequence..last_sequence, element i
-- being the event at first_sequence + i, whose id is first_id + i (as a
-- 128-bit number; first_id's low 16 bits are zero). No `events` row has a
-- sequence inside a slice's range.
CREATE TABLE converged_event_slices (
    first_sequence  bigint      PRIMARY KEY,
    last_sequence   bigint      NOT NULL,
    first_id        uuid        NOT NULL,
    run_id          uuid        NOT NULL,
    source          text        NOT NULL,
    time            timestamptz NOT NULL,
    subjects        text[]      NOT NULL,
    generations     bigint[]    NOT NULL,
    health          text[]      NOT NULL,
    CONSTRAINT converged_event_slices_range CHECK (
        cardinality(subjects) > 0
        AND last_sequence = first_sequence + cardinality(subjects) - 1
        AND cardinality(generations) = cardinality(subjects)
        AND cardinality(health) = cardinality(subjects))
);

CREATE INDEX converged_event_slices_last ON converged_event_slices (last_sequence);
CREATE INDEX converged_event_slices_run ON converged_event_slices (run_id, first_sequence);

-- Every event's sequence, type, subject, run and time, one row per event,
-- whichever way it is stored (the full CloudEvent of a converged one is
-- built by `server/src/events/log.rs`).
CREATE VIEW event_log AS
    SELECT sequence, type, subject, run_id, time FROM events
    UNION ALL
    SELECT s.first_sequence + u.ordinality - 1, 'io.idem.device.already_converged',
           u.subject, s.run_id, s.time
    FROM converged_event_slices s, unnest(s.subjects) WITH ORDINALITY AS u (subject, ordinality);
