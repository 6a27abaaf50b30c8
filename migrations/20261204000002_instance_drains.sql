-- A stopped or dead instance's MQTT session is drained by a survivor
-- (shared subscriptions): while it does, the survivor holds the gone
-- instance's row (holder, host, pid are the survivor's) and names itself
-- here; the row is deleted when the session is drained and removed.
ALTER TABLE instances ADD COLUMN drained_by text;
