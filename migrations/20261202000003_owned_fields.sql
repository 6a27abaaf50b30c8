-- The spec paths devices own (PUT /v1/owned-fields): one declaration,
-- server-wide paths and paths per label selector, as the API takes it.
CREATE TABLE owned_fields (
    singleton   boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    declaration jsonb       NOT NULL,
    updated_by  text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
