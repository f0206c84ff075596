-- The usage and savings ledger (docs/usage.md). Tokens the provider reported for each attempt:
-- NULL where it did not say (never guessed); an attempt abandoned or interrupted mid-stream
-- keeps what was reported before it ended.
CREATE TABLE attempt_usage (
    request_id          UUID NOT NULL,
    attempt             INTEGER NOT NULL CHECK (attempt >= 1),
    input_tokens        BIGINT,
    output_tokens       BIGINT,
    cached_input_tokens BIGINT,
    cache_write_tokens  BIGINT,
    reasoning_tokens    BIGINT,
    PRIMARY KEY (request_id, attempt)
);

-- Client submissions a request answered beyond the one that created it: attached to a running
-- execution, or replayed from storage; and log readers (`GET /requests/{id}` event streams).
ALTER TABLE requests ADD COLUMN attached INTEGER NOT NULL DEFAULT 0;
ALTER TABLE requests ADD COLUMN replayed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE requests ADD COLUMN log_reads INTEGER NOT NULL DEFAULT 0;

-- The usage of the attempt that gave the request's answer (the last one that reported any),
-- what a saved call would have cost; copied here so a replay or a list needs no join.
ALTER TABLE requests ADD COLUMN usage_input_tokens BIGINT;
ALTER TABLE requests ADD COLUMN usage_output_tokens BIGINT;
ALTER TABLE requests ADD COLUMN usage_cached_input_tokens BIGINT;
ALTER TABLE requests ADD COLUMN usage_cache_write_tokens BIGINT;
ALTER TABLE requests ADD COLUMN usage_reasoning_tokens BIGINT;

CREATE INDEX requests_created ON requests (created_at);
