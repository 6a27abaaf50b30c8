-- Drift exemptions (POST /v1/exemptions): for one device or the devices a
-- label selector matches, until expires_at. An exempt device's drift is
-- detected and evented, never remediated. Expired rows are deleted by the
-- server (the audit trail keeps who made and removed each).
CREATE TABLE exemptions (
    id          uuid        PRIMARY KEY,
    device_id   text        REFERENCES devices (id) ON DELETE CASCADE,
    selector    jsonb,
    reason      text        NOT NULL,
    author      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    CHECK (num_nonnulls(device_id, selector) = 1)
);
CREATE INDEX exemptions_expires_at ON exemptions (expires_at);
