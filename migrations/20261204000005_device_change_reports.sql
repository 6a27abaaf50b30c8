-- A transaction that stored reports and connection states alone (the
-- ingest's) changed only the reported columns and `online`: a follower
-- reads those, not the whole row with its desired spec and labels.
ALTER TABLE device_changes ADD COLUMN reports_only boolean NOT NULL DEFAULT false;
