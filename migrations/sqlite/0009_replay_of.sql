-- A replay's link to the request it replays (SPEC EX-7, EX-8; decision 64). Written once with
-- the submission, never updated: it lives beside the body in `request_bodies`, not in the
-- `requests` row that every write rewrites (decision 35).
ALTER TABLE request_bodies ADD COLUMN replay_of TEXT;
CREATE INDEX request_bodies_replay_of ON request_bodies (replay_of) WHERE replay_of IS NOT NULL;
