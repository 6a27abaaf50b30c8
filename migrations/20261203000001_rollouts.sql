-- A staged rollout (`rollout` of POST /v1/desired or of a plan's apply):
-- its waves, counts, state, author and approvals as JSON, rewritten in the
-- transaction of every write that moves it; NULL for every other run.
ALTER TABLE runs ADD COLUMN rollout jsonb;
-- The wave of each target of a rollout that needed a push when the run
-- was created (NULL for targets decided at creation and for other runs).
ALTER TABLE run_targets ADD COLUMN wave smallint;
