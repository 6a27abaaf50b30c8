-- Where each consumer of the event log has got to (e.g. the MQTT relay), so a
-- restarted server continues without republishing or skipping.
CREATE TABLE event_cursors (
    name      text   PRIMARY KEY,
    sequence  bigint NOT NULL
);
