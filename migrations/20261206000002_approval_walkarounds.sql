-- Approval that cannot be walked around (OPERATIONS §14).
--
-- An exemption made while its devices needed approval waits for another
-- operator's (needs_approval, until approved_by is set); one no second
-- operator approved never exempts a device a policy covers.
ALTER TABLE exemptions ADD COLUMN needs_approval boolean NOT NULL DEFAULT false;
ALTER TABLE exemptions ADD COLUMN approval_reason text;
ALTER TABLE exemptions ADD COLUMN approved_by text;
ALTER TABLE exemptions ADD COLUMN approved_at timestamptz;

-- A declaration of owned fields that would change what devices a policy
-- covers own: kept here, not in force, until a token other than its
-- author's approves it (one per author; a newer one replaces it). based_on
-- is the updated_at of the declaration it replaces (NULL: none), so an
-- approval never puts back an older one.
CREATE TABLE owned_fields_proposals (
    id          uuid        PRIMARY KEY,
    declaration jsonb       NOT NULL,
    author      text        NOT NULL UNIQUE,
    based_on    timestamptz,
    reason      text        NOT NULL,
    devices_changed bigint  NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- A device deleted while a policy covered it (policy_id) or while every
-- change needed approval (policy_id NULL): registered again, it is still
-- covered by that policy whatever its new labels, and its first desired
-- spec is a change that needs approval. Gone with its policy.
CREATE TABLE covered_departures (
    device_id   text        NOT NULL,
    policy_id   uuid        REFERENCES approval_policies (id) ON DELETE CASCADE,
    departed_at timestamptz NOT NULL DEFAULT now(),
    departed_by text        NOT NULL
);
CREATE UNIQUE INDEX covered_departures_device_policy
    ON covered_departures (device_id, COALESCE(policy_id, '00000000-0000-0000-0000-000000000000'::uuid));
