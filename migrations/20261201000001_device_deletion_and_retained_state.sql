-- Deleting a device keeps the outcomes it had in past runs: run history stays
-- whole (run counts and their target rows agree), the id is kept as text.
ALTER TABLE run_targets DROP CONSTRAINT run_targets_device_id_fkey;

-- The generation of the retained desired message the server last published
-- for the device; NULL when the broker holds none for it. When desired state
-- changes, the retained message of every device that has one is refreshed,
-- so a rebooting device never receives a withdrawn generation.
ALTER TABLE devices ADD COLUMN retained_generation bigint;

-- Devices pushed to before this column existed may hold a retained message
-- of any generation: 0 marks it as unknown, so the server refreshes it.
UPDATE devices SET retained_generation = 0
WHERE id IN (SELECT DISTINCT device_id FROM device_attempts);
