-- idem schema v1: devices (desired + reported + status), runs, per-device run
-- outcomes, and the gap-free event log.

CREATE TABLE devices (
    id                   text PRIMARY KEY,
    labels               jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- desired state, written by operators through the API
    desired_spec         jsonb,
    desired_generation   bigint      NOT NULL DEFAULT 0,
    desired_digest       text,
    desired_at           timestamptz,
    -- last report that was accepted (highest seq so far)
    reported_spec        jsonb,
    reported_digest      text,
    reported_seq         bigint,
    reported_generation  bigint,
    reported_error_generation bigint,
    reported_error       text,
    reported_health      text,
    reported_at          timestamptz,
    -- reconciliation state
    status               text        NOT NULL DEFAULT 'unknown',
    online               boolean,
    attempts             integer     NOT NULL DEFAULT 0,
    next_attempt_at      timestamptz,
    last_error           text,
    last_outcome         text,
    last_outcome_reason  text,
    last_run_id          uuid,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT devices_status_known CHECK (status IN
        ('unknown', 'converged', 'drifted', 'provisioning', 'failed', 'offline', 'quarantined'))
);

CREATE INDEX devices_status_idx ON devices (status);
CREATE INDEX devices_labels_idx ON devices USING gin (labels jsonb_path_ops);

CREATE TABLE runs (
    id                 uuid PRIMARY KEY,
    trigger            text        NOT NULL,
    state              text        NOT NULL DEFAULT 'running',
    force              boolean     NOT NULL DEFAULT false,
    target_count       integer     NOT NULL,
    already_converged  integer     NOT NULL DEFAULT 0,
    provisioned        integer     NOT NULL DEFAULT 0,
    failed             integer     NOT NULL DEFAULT 0,
    skipped            integer     NOT NULL DEFAULT 0,
    superseded         integer     NOT NULL DEFAULT 0,
    started_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz,
    CONSTRAINT runs_state_known CHECK (state IN ('running', 'completed'))
);

CREATE INDEX runs_started_idx ON runs (started_at DESC);

CREATE TABLE run_targets (
    run_id      uuid   NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    device_id   text   NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    -- null until the device has its outcome for this run
    outcome     text,
    reason      text,
    generation  bigint,
    health      text,
    decided_at  timestamptz,
    PRIMARY KEY (run_id, device_id),
    CONSTRAINT run_targets_outcome_known CHECK (outcome IS NULL OR outcome IN
        ('already_converged', 'provisioned', 'failed', 'skipped', 'superseded'))
);

CREATE INDEX run_targets_device_idx ON run_targets (device_id);

-- Gap-free event sequence: one row, incremented inside the transaction that
-- writes the events, so a rolled-back transaction leaves no hole.
CREATE TABLE event_sequence (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last       bigint  NOT NULL
);
INSERT INTO event_sequence (singleton, last) VALUES (true, 0);

CREATE TABLE events (
    sequence    bigint      PRIMARY KEY,
    id          uuid        NOT NULL UNIQUE,
    type        text        NOT NULL,
    subject     text        NOT NULL,
    run_id      uuid,
    time        timestamptz NOT NULL,
    -- the complete CloudEvent, JSON structured mode
    cloudevent  jsonb       NOT NULL
);

CREATE INDEX events_run_idx ON events (run_id, sequence);
CREATE INDEX events_subject_idx ON events (subject, sequence);
