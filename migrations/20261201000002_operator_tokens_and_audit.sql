-- Operator identity: bearer tokens (only their SHA-256 is stored) with a
-- role, and the audit trail of every mutating API call.
CREATE TABLE api_tokens (
    id          uuid        PRIMARY KEY,
    name        text        NOT NULL UNIQUE,
    role        text        NOT NULL,
    token_hash  bytea       NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    created_by  text,
    expires_at  timestamptz,
    revoked_at  timestamptz,
    CONSTRAINT api_tokens_role_known CHECK (role IN ('viewer', 'operator', 'admin'))
);

CREATE TABLE audit_log (
    id          bigserial   PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    -- token name, or `anonymous` when the server runs without auth
    actor       text        NOT NULL,
    role        text        NOT NULL,
    method      text        NOT NULL,
    -- the route, e.g. /v1/devices/{id}/desired, and the concrete path
    route       text        NOT NULL,
    path        text        NOT NULL,
    status      integer     NOT NULL,
    targets     integer,
    generation  bigint,
    run_id      uuid,
    detail      jsonb
);

CREATE INDEX audit_log_actor_idx ON audit_log (actor, id);
CREATE INDEX audit_log_run_idx ON audit_log (run_id) WHERE run_id IS NOT NULL;

-- Who started a run through the API (token name); NULL for runs the server
-- starts itself (the trigger says why).
ALTER TABLE runs ADD COLUMN started_by text;

-- The Mosquitto `password_file` hash ($7$, PBKDF2-SHA512) of the broker
-- password issued to the device, for `idem-server broker files`; the
-- password itself is shown once and never stored.
ALTER TABLE devices ADD COLUMN broker_password_hash text;
