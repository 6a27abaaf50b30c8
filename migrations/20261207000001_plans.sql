-- Plans (POST /v1/plans), kept where every instance reads them and across
-- restarts: each until it expired as long ago as it lived. `devices` holds
-- every planned device with the state it was computed on; the rest is what
-- the book's rules read. `state` is open, applying (a call claimed it at
-- `claimed_at` and is starting its run) or applied (by `applied_run`).
CREATE TABLE plans (
    id          uuid        PRIMARY KEY,
    author      text        NOT NULL,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    targeting   jsonb       NOT NULL,
    spec        jsonb       NOT NULL,
    digest      text        NOT NULL,
    force       boolean     NOT NULL,
    counts      jsonb       NOT NULL,
    devices     jsonb       NOT NULL,
    state       text        NOT NULL DEFAULT 'open'
                            CHECK (state IN ('open', 'applying', 'applied')),
    claimed_at  timestamptz,
    applied_run uuid,
    approved_by text,
    approved_at timestamptz
);
CREATE INDEX plans_author ON plans (author, created_at);

-- A plan is applied by one run at most, whichever instance applies it.
CREATE UNIQUE INDEX runs_one_per_plan ON runs (plan_id) WHERE plan_id IS NOT NULL;
