-- A target whose report differed from its desired spec when its run was
-- created: found converged later in the run (by whichever instance carries
-- it then), it got there during the run and counts as provisioned, never
-- as already converged.
ALTER TABLE run_targets ADD COLUMN differed boolean NOT NULL DEFAULT false;
