-- A replay's link to the request it replays (SPEC EX-7, EX-8; decision 64), written with the
-- submission.
ALTER TABLE requests ADD COLUMN replay_of UUID;
CREATE INDEX requests_replay_of ON requests (replay_of) WHERE replay_of IS NOT NULL;
