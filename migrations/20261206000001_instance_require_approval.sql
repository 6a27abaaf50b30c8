-- Whether each live instance requires approval of every desired change
-- (--require-approval): the setting is the fleet's, so an instance whose
-- setting differs from a live one's refuses to start.
ALTER TABLE instances ADD COLUMN require_approval boolean NOT NULL DEFAULT false;
