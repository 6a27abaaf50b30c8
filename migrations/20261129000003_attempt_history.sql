-- Every ended push attempt, so an operator sees a device's failures and the
-- attempt that finally worked.
CREATE TABLE device_attempts (
    id          bigserial   PRIMARY KEY,
    device_id   text        NOT NULL REFERENCES devices (id) ON DELETE CASCADE,
    run_id      uuid,
    attempt     integer     NOT NULL,
    generation  bigint,
    result      text        NOT NULL,
    reason      text,
    at          timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX device_attempts_device_idx ON device_attempts (device_id, id DESC);
