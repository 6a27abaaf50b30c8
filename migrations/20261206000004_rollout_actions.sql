-- Actions on a rollout (resume, abort, approve) asked through an instance
-- that does not carry the engine: the engine's holder claims each, carries
-- it out and writes the answer, which the asking instance reads and
-- deletes. `answer` is the rollout as stored after the action; a refusal is
-- `refusal` (self_approval, not_in_progress, not_now) with its message.
CREATE TABLE rollout_actions (
    id          uuid        PRIMARY KEY,
    run_id      uuid        NOT NULL,
    action      text        NOT NULL CHECK (action IN ('resume', 'abort', 'approve')),
    by          text        NOT NULL,
    asked_at    timestamptz NOT NULL DEFAULT now(),
    claimed_by  uuid,
    answered_at timestamptz,
    answer      jsonb,
    refusal     text,
    message     text
);
CREATE INDEX rollout_actions_unclaimed ON rollout_actions (asked_at) WHERE claimed_by IS NULL;
