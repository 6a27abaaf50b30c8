-- The plan a run applied (POST /v1/plans/{id}/apply); NULL for every other
-- run. Plans themselves live in the server's memory, not here.
ALTER TABLE runs ADD COLUMN plan_id uuid;
