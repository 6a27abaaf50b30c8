-- Approval policies (POST /v1/approval-policies): a desired change that
-- touches a device whose labels contain a policy's selector is applied only
-- through a plan another operator approved.
CREATE TABLE approval_policies (
    id          uuid        PRIMARY KEY,
    selector    jsonb       NOT NULL,
    reason      text        NOT NULL,
    author      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
-- The approval of the plan a run applied: who approved it, and when.
ALTER TABLE runs ADD COLUMN approved_by text;
ALTER TABLE runs ADD COLUMN approved_at timestamptz;
